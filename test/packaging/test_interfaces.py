"""The generated interfaces: every msg/srv/action file imports, serialises and keeps the documented shape.

The interface list comes from the files in msg/ srv/ action/, so a new file is covered without editing
this test. Values are filled in field by field (distinct per field) so that a field lost, truncated or
swapped in the generated typesupport shows up as an unequal round trip.
"""
import importlib
import pathlib

import pytest
from rclpy.serialization import deserialize_message, serialize_message
from rosidl_adapter.parser import parse_message_string
from rosidl_parser.definition import (AbstractNestedType, AbstractString, AbstractWString, BasicType,
                                      NamespacedType)

from flashrt_ros.runtime.errors import ErrorCode as RuntimeErrorCode

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "flashrt_ros"


def interface_files(kind: str) -> list[pathlib.Path]:
    return sorted((ROOT / kind).glob(f"*.{kind}"))


def interface_class(kind: str, name: str):
    return getattr(importlib.import_module(f"{PACKAGE}.{kind}"), name)


def _message_class(ns_type: NamespacedType):
    return getattr(importlib.import_module(".".join(ns_type.namespaces)), ns_type.name)


def _sample(slot_type, index: int):
    """A value for one field: non-default, distinct per field index, exact in float32."""
    if isinstance(slot_type, AbstractNestedType):
        return [_sample(slot_type.value_type, index + k) for k in range(3)]
    if isinstance(slot_type, (AbstractString, AbstractWString)):
        return f"field {index} ✓"
    if isinstance(slot_type, NamespacedType):
        return filled(_message_class(slot_type))
    assert isinstance(slot_type, BasicType), slot_type
    if slot_type.typename == "boolean":
        return True
    if slot_type.typename in ("float", "double"):
        return index + 1.5
    if slot_type.typename in ("octet", "char"):
        return bytes([index + 1]) if slot_type.typename == "octet" else chr(ord("a") + index)
    return index + 1


def filled(cls):
    """An instance of a generated message class with every field set to a sample value."""
    msg = cls()
    for index, (name, slot_type) in enumerate(zip(cls.get_fields_and_field_types(), cls.SLOT_TYPES)):
        setattr(msg, name, _sample(slot_type, index))
    return msg


def _messages():
    for path in interface_files("msg"):
        yield pytest.param(interface_class("msg", path.stem), id=f"msg/{path.stem}")
    for path in interface_files("srv"):
        srv = interface_class("srv", path.stem)
        yield pytest.param(srv.Request, id=f"srv/{path.stem}.Request")
        yield pytest.param(srv.Response, id=f"srv/{path.stem}.Response")
    for path in interface_files("action"):
        action = interface_class("action", path.stem)
        for part in ("Goal", "Result", "Feedback"):
            yield pytest.param(getattr(action, part), id=f"action/{path.stem}.{part}")


def test_every_interface_file_is_generated():
    files = [p for kind in ("msg", "srv", "action") for p in interface_files(kind)]
    assert files, "no interface files found"
    for path in files:
        assert interface_class(path.parent.name, path.stem).__module__.startswith(f"{PACKAGE}.")


@pytest.mark.parametrize("cls", list(_messages()))
def test_round_trip_through_rclpy_serialization(cls):
    msg = filled(cls)
    if cls.get_fields_and_field_types():  # (an empty request has nothing to fill)
        assert msg != cls(), "the sample must differ from the default instance"
    data = serialize_message(msg)
    assert deserialize_message(data, cls) == msg


@pytest.mark.parametrize("path", interface_files("srv"), ids=lambda p: p.stem)
def test_service_responses_carry_success_message_error_code(path):
    fields = interface_class("srv", path.stem).Response.get_fields_and_field_types()
    assert list(fields)[:3] == ["success", "message", "error_code"]
    assert [fields["success"], fields["message"], fields["error_code"]] == ["boolean", "string", "uint16"]


def test_generate_result_carries_success_message_error_code():
    fields = interface_class("action", "Generate").Result.get_fields_and_field_types()
    assert {k: fields[k] for k in ("success", "message", "error_code")} == {
        "success": "boolean", "message": "string", "error_code": "uint16"}


def test_error_code_constants_match_the_runtime():
    text = (ROOT / "msg" / "ErrorCode.msg").read_text()
    declared = {c.name: c.value for c in parse_message_string(PACKAGE, "ErrorCode", text).constants}
    generated = interface_class("msg", "ErrorCode")
    assert {name: getattr(generated, name) for name in declared} == declared
    assert declared == {code.name: int(code) for code in RuntimeErrorCode}
