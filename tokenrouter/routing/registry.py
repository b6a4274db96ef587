"""Finding a routing algorithm's class from a spec: a registered name, `pkg.module:Class`, or
`path/to/file.py:Class`.

Names come from one table: the built-in algorithms (BUILTIN_ALGORITHMS) and, after them, the
entry points of the group `tokenrouter.algorithms` that installed packages declare
(`[project.entry-points."tokenrouter.algorithms"] cascade = "my_lab.cascade:Cascade"`). tokenrouter
declares its built-ins there too; the table is what an uninstalled checkout still finds, and a
built-in name wins over an entry point of the same name. Every process of a group (the entry and
each subserver, spawned, joined or a Ray actor) resolves the same spec the same way.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from tokenrouter.routing.algorithm import RoutingAlgorithm
from tokenrouter.routing.bernoulli import Bernoulli
from tokenrouter.routing.citer import Citer
from tokenrouter.routing.co_llm import CoLLM
from tokenrouter.routing.ensemble import Ensemble
from tokenrouter.routing.r2r import R2R
from tokenrouter.routing.r_stitch import RStitch
from tokenrouter.routing.single import SingleModel
from tokenrouter.routing.speculative import Speculative

ENTRY_POINT_GROUP = "tokenrouter.algorithms"
BUILTIN_ALGORITHMS: dict[str, type[RoutingAlgorithm]] = {
    cls.name: cls for cls in (SingleModel, Bernoulli, Citer, R2R, CoLLM, RStitch, Ensemble, Speculative)}


def registered_names() -> list[str]:
    """Every algorithm name a spec may use: the built-ins and the installed entry points."""
    return sorted({*BUILTIN_ALGORITHMS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def is_file_spec(spec: str) -> bool:
    return ":" in spec and spec.rsplit(":", 1)[0].endswith(".py")


def absolute_spec(spec: str, base: str | Path | None = None) -> str:
    """`spec` with a relative file path made absolute (against `base`, else the working directory),
    so that every process, whatever its working directory, imports the same file."""
    if not is_file_spec(spec):
        return spec
    path, cls = spec.rsplit(":", 1)
    return f"{(Path(base or '.') / path).resolve()}:{cls}"


def algorithm_class(spec: str) -> type[RoutingAlgorithm]:
    """The RoutingAlgorithm subclass `spec` names; ValueError saying which module, which class and
    why it failed."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"algorithm: expected a name or 'module:Class', got {spec!r}")
    if ":" not in spec:
        cls = BUILTIN_ALGORITHMS.get(spec)
        if cls is not None:
            return cls
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not found:
            raise ValueError(f"unknown routing algorithm {spec!r}; available: {', '.join(registered_names())}, "
                             "or 'package.module:Class', or 'path/to/file.py:Class'")
        target = found[0].value
        try:
            loaded = found[0].load()
        except Exception as e:  # noqa: BLE001 - any import failure is reported the same way
            raise ValueError(f"algorithm {spec!r} (entry point {target}): cannot load it: "
                             f"{type(e).__name__}: {e}") from None
        return _checked(loaded, f"{spec!r} (entry point {target})")
    where, _, attr = spec.rpartition(":")
    module = _import_file(where, spec) if is_file_spec(spec) else _import_module(where, spec)
    if not attr.isidentifier():
        raise ValueError(f"algorithm {spec!r}: {attr!r} is not a class name")
    if not hasattr(module, attr):
        raise ValueError(f"algorithm {spec!r}: module {where!r} has no class {attr!r}")
    return _checked(getattr(module, attr), repr(spec))


def make_algorithm(spec: str, models: list[str], params: dict[str, Any] | None = None) -> RoutingAlgorithm:
    """An instance of the algorithm `spec` names over `models` with the group's `params`."""
    cls = algorithm_class(spec)
    try:
        return cls(models, **(params or {}))
    except TypeError as e:
        raise ValueError(f"{spec}: bad parameters {params}: {e}") from None


def _checked(obj: Any, what: str) -> type[RoutingAlgorithm]:
    if not (isinstance(obj, type) and issubclass(obj, RoutingAlgorithm)):
        raise ValueError(f"algorithm {what}: {obj!r} is not a subclass of tokenrouter.routing.RoutingAlgorithm")
    if getattr(obj, "__abstractmethods__", None):
        raise ValueError(f"algorithm {what}: {obj.__name__} does not implement "
                         f"{', '.join(sorted(obj.__abstractmethods__))}")
    if not isinstance(getattr(obj, "name", None), str):
        raise ValueError(f"algorithm {what}: {obj.__name__} has no `name` (a class attribute string)")
    return obj


def _import_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - not found, or the module itself failed
        raise ValueError(f"algorithm {spec!r}: cannot import module {name!r}: {type(e).__name__}: {e}") from None


def _import_file(path: str, spec_text: str) -> Any:
    """The module of a Python file, imported once per process under a name derived from its path."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"algorithm {spec_text!r}: no such file {path!r}")
    name = f"tokenrouter_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[name]
        raise ValueError(f"algorithm {spec_text!r}: cannot import file {path!r}: {type(e).__name__}: {e}") from None
    return module
