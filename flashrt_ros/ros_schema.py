"""ROS message types as JSON schemas, and JSON back to typed messages (``output_type`` of a Generate goal).

The schema comes from the rosidl introspection of the generated Python class (``SLOT_TYPES`` and
``get_fields_and_field_types()``): nested messages become objects with every field required and no others, arrays
have exactly their size, bounded sequences and strings their bound, integers the range of their type, floats are
numbers. A type that cannot be imported or mapped is INVALID_ARGUMENT naming why.
"""
from __future__ import annotations

import importlib
import json

from rosidl_parser import definition as idl

from flashrt_ros.runtime.errors import ErrorCode, FlashRTError

_INT_BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64, "uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64,
             "octet": 8, "byte": 8}
_FLOATS = {"float", "double", "long double", "float32", "float64"}


def _bad(why: str) -> FlashRTError:
    return FlashRTError(ErrorCode.INVALID_ARGUMENT, f"output_type: {why}")


def message_class(type_name: str):
    """The message class named ``pkg/msg/Name``."""
    parts = type_name.split("/")
    if len(parts) != 3 or parts[1] != "msg" or not all(p.isidentifier() for p in parts):
        raise _bad(f"{type_name!r} is not a message type name like 'geometry_msgs/msg/Twist'")
    try:
        cls = getattr(importlib.import_module(f"{parts[0]}.msg"), parts[2])
    except (ImportError, AttributeError) as exc:
        raise _bad(f"cannot import {type_name!r}: {exc}") from None
    if not hasattr(cls, "SLOT_TYPES"):
        raise _bad(f"{type_name!r} is not a generated ROS message class")
    return cls


def _nested_class(t: idl.NamespacedType):
    return message_class("/".join([*t.namespaces, t.name]))


def _integer(typename: str) -> dict:
    bits = _INT_BITS[typename]
    if typename.startswith("int"):
        return {"type": "integer", "minimum": -2 ** (bits - 1), "maximum": 2 ** (bits - 1) - 1}
    return {"type": "integer", "minimum": 0, "maximum": 2 ** bits - 1}


def _schema_of(t, path: str) -> dict:
    if isinstance(t, idl.NamespacedType):
        return message_schema(_nested_class(t), path)
    if isinstance(t, idl.AbstractGenericString):
        bound = getattr(t, "maximum_size", None)
        return {"type": "string", **({"maxLength": bound} if bound else {})}
    if isinstance(t, idl.Array):
        return {"type": "array", "items": _schema_of(t.value_type, path), "minItems": t.size, "maxItems": t.size}
    if isinstance(t, idl.AbstractSequence):
        bound = getattr(t, "maximum_size", None)
        return {"type": "array", "items": _schema_of(t.value_type, path), **({"maxItems": bound} if bound else {})}
    if isinstance(t, idl.BasicType):
        if t.typename == "boolean":
            return {"type": "boolean"}
        if t.typename in _INT_BITS:
            return _integer(t.typename)
        if t.typename in _FLOATS:
            return {"type": "number"}
    raise _bad(f"field {path} has a type that has no JSON schema ({type(t).__name__})")


def message_schema(cls, path: str = "") -> dict:
    """The JSON schema of a message class (fields in declaration order, all required, no others)."""
    names = list(cls.get_fields_and_field_types())
    props = {name: _schema_of(t, f"{path}{name}") for name, t in zip(names, cls.SLOT_TYPES)}
    return {"type": "object", "properties": props, "required": names, "additionalProperties": False}


def schema_for(type_name: str) -> str:
    """The JSON schema text of the message type ``type_name``; INVALID_ARGUMENT naming why when there is none."""
    return json.dumps(message_schema(message_class(type_name)))


def _value(t, value):
    if isinstance(t, idl.NamespacedType):
        return _message(_nested_class(t), value)
    if isinstance(t, (idl.Array, idl.AbstractSequence)):
        items = [_value(t.value_type, v) for v in value]
        if isinstance(t.value_type, idl.BasicType) and t.value_type.typename in ("octet", "byte"):
            return bytes(items)
        return items
    if isinstance(t, idl.BasicType) and t.typename in _FLOATS:
        return float(value)                   # JSON "1" for a float field
    if isinstance(t, idl.BasicType) and t.typename in ("octet", "byte"):
        return bytes([value])
    return value


def _message(cls, obj: dict):
    msg = cls()
    for (name, _), t in zip(cls.get_fields_and_field_types().items(), cls.SLOT_TYPES):
        setattr(msg, name, _value(t, obj[name]))
    return msg


def parse_message(type_name: str, text: str):
    """The typed message that ``text`` (JSON valid against :func:`schema_for`) describes."""
    return _message(message_class(type_name), json.loads(text))
