"""The house rules that keep numbactr readable (CONTRIBUTING.md): at most 12 modules directly in numbactr/, no
file outside kernels/ over 800 lines, no import circle (imports inside functions included), and every package
in pyproject.toml's list so that a built wheel holds it. `python3 .ci/house.py` prints the same figures;
.ci/run also runs ruff and import-linter's layer contracts."""

import importlib.util
import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("house", ROOT / ".ci" / "house.py")
house = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(house)


def test_at_most_twelve_modules_directly_in_numbactr():
    top = house.report()["modules_in_numbactr"]
    assert len(top) <= 12, top


def test_no_file_outside_kernels_over_800_lines():
    assert house.report()["over_800"] == {}


def test_no_import_circles():
    assert house.circles(house.import_graph(house.modules())) == []


def test_circles_are_found_through_imports_inside_functions(tmp_path):
    """The detector itself: two modules that import each other only inside functions are a circle."""
    pkg = tmp_path / "numbactr"
    (pkg / "a").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from numbactr.a import y\n")
    (pkg / "a" / "y.py").write_text("def g():\n    from . import x\n")
    (pkg / "z.py").write_text("import numbactr.a.x\n")
    assert house.circles(house.import_graph(house.modules(tmp_path))) == [["numbactr.a.x", "numbactr.a.y"]]


def test_every_package_is_listed_for_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    have = {"numbactr", "numbactr.kernels"} | {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "numbactr").rglob("__init__.py")
        if p.parent.relative_to(ROOT / "numbactr").parts[:1] != ("kernels",)
    }
    assert have - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"
    assert listed - have == set(), "pyproject.toml lists packages that do not exist"


def test_the_architecture_drawing_names_every_module_and_package():
    """docs/concepts/architecture.md draws the package: it must name each of numbactr/'s modules and packages."""
    drawing = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    pkg = ROOT / "numbactr"
    names = [p.name for p in pkg.glob("*.py")] + [p.name + "/" for p in pkg.iterdir() if (p / "__init__.py").exists()]
    missing = [n for n in names if n not in drawing and n.rstrip("/") + " ->" not in drawing]
    assert not missing, f"docs/concepts/architecture.md does not name {missing}"
