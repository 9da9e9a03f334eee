"""ARCHITECTURE.md's module map matches the package: every module it names exists, every module is named."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "ARCHITECTURE.md"
# rosidl generates these into the installed package; a checkout that has them (a build in place) is not the map's
GENERATED = ("msg", "srv", "action")


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def named_in_map() -> set[str]:
    return {path for path in re.findall(r"`(flashrt_ros/[\w/.]*)`", section(DOC.read_text(), "Module map"))
            if path.endswith((".py", "/"))}


def in_the_tree() -> set[str]:
    """Each module as its path, each package as its folder with a trailing slash."""
    found = set()
    for path in (ROOT / "flashrt_ros").rglob("*.py"):
        relative = path.relative_to(ROOT)
        if "__pycache__" in relative.parts or relative.parts[1] in GENERATED:
            continue
        found.add(f"{relative.parent}/" if path.name == "__init__.py" else str(relative))
    return found


def test_the_module_map_names_every_module_and_only_those():
    named, tree = named_in_map(), in_the_tree()
    assert sorted(tree - named) == [], "modules missing from ARCHITECTURE.md's module map"
    assert sorted(named - tree) == [], "ARCHITECTURE.md's module map names modules that do not exist"


def test_every_module_path_in_the_text_exists():
    """Outside the map the text names modules relative to flashrt_ros/ (``runtime/engine.py``)."""
    paths = set(re.findall(r"`((?:flashrt_ros/)?[\w/]+\.py)`", DOC.read_text()))
    assert paths
    missing = [p for p in paths if not (ROOT / p).is_file() and not (ROOT / "flashrt_ros" / p).is_file()]
    assert missing == []


def test_the_readme_links_it():
    assert "(ARCHITECTURE.md)" in (ROOT / "README.md").read_text()
