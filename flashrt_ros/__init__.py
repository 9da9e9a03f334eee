"""flashrt_ros: execution-state capsules for a hybrid LLM, served over ROS 2.

One Python package holds two halves that may live in different directories:

* the hand-written sources (``runtime/``, ``node.py``, ...), e.g. a checkout on ``PYTHONPATH``;
* the modules that rosidl generates from ``msg/ srv/ action/`` (``flashrt_ros.msg``, ``.srv``, ``.action``
  and their typesupport extensions), which ``pip install .`` or ``colcon build`` put into site-packages.

``pkgutil.extend_path`` appends every other ``flashrt_ros`` directory found on ``sys.path`` to this
package's ``__path__``, so ``flashrt_ros.runtime`` can come from the checkout while ``flashrt_ros.msg``
comes from site-packages. Where both halves are installed into one directory (pip, colcon) it changes
nothing. The entry earlier on ``sys.path`` wins for a module present in both, so a checkout on
``PYTHONPATH`` overrides an installed copy of the same source file.

Keep this file free of imports beyond ``pkgutil``: ``import flashrt_ros.runtime`` must not pay for ROS,
and generated modules import this package too.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
