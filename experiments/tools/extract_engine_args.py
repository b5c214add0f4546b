"""Extract the real engines' argument names from their released wheels (for ``kvsched export``).

Downloads a released wheel from PyPI (``pip download <pkg>==<version> --no-deps``; nothing is
installed or imported), parses its source with :mod:`ast` and writes
``experiments/engine_args/<engine>.json``:

* vLLM: the fields of ``EngineArgs`` (``vllm/engine/arg_utils.py``), as kebab-case flags
  (vLLM's ``add_cli_args`` derives every ``--flag`` from a field name this way, and
  ``vllm serve --config FILE`` takes the same names as YAML keys), plus the values of the
  ``Literal`` aliases ``CacheDType`` (``vllm/config/cache.py``, ``--kv-cache-dtype``) and
  ``SchedulerPolicy`` (``vllm/config/scheduler.py``, ``--scheduling-policy``).
* SGLang: the CLI flags of ``ServerArgs``. Up to ~0.5.1x these are its dataclass fields in
  ``sglang/srt/server_args.py``, kebab-case (``add_cli_args`` uses ``--field-name``). Later
  releases (0.5.23) declare them in namespaces ``sglang/srt/arg_groups/fields/*.py`` as
  ``A[T, "help"]`` / ``A[T, Arg(...)]`` annotations, registered by
  ``arg_utils.add_cli_args_from_dataclass`` as ``Arg.cli_name`` or ``--field-name`` (plus
  ``Arg.aliases``, skipping ``no_cli``); a few (``--config``, deprecated flags) are added by
  hand with ``parser.add_argument("--...")`` in ``server_args.py``. Both forms are read.

The committed JSON files are what ``kvsched export`` checks every key against, and a test
checks that the exporters only write names in them: a flag renamed upstream fails once the
lists are refreshed with this script.

Usage::

    python -m kvsched.experiments.tools.extract_engine_args --vllm 0.33.0 --sglang 0.5.23
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from kvsched import atomic_files
from kvsched.envs.sim.errors import MAX_PATH_CHARS, bounded_repr

OUT_DIR = Path(__file__).resolve().parent.parent / "engine_args"


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """``pip download package==version --no-deps --only-binary :all:`` into ``dest``; the wheel path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                    "-d", str(dest), f"{package}=={version}"], check=True)
    wheels = sorted(dest.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"no wheel of {package}=={version} in {bounded_repr(str(dest), MAX_PATH_CHARS)}")
    return wheels[0]


def dataclass_fields(source: str, class_name: str) -> list[str]:
    """Names of the annotated class-level fields of ``class_name`` (ClassVar and private skipped)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            out = []
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    ann = ast.unparse(stmt.annotation)
                    if ann.startswith(("ClassVar", "typing.ClassVar")) or stmt.target.id.startswith("_"):
                        continue
                    out.append(stmt.target.id)
            return out
    raise SystemExit(f"class {class_name} not found")


def literal_values(source: str, alias: str) -> list[str]:
    """The string values of ``alias = Literal[...]`` in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == alias for t in targets) and node.value is not None:
                sub = node.value
                if isinstance(sub, ast.Subscript) and ast.unparse(sub.value).endswith("Literal"):
                    elts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
                    return [e.value for e in elts if isinstance(e, ast.Constant)]
    raise SystemExit(f"Literal alias {alias} not found")


def annotated_cli_flags(source: str) -> set[str]:
    """Flags of ``field: A[T, "help"]`` / ``A[T, Arg(cli_name=..., aliases=[...], no_cli=...)]``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            ann = stmt.annotation
            if not (isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "A"):
                continue
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            meta = elts[1] if len(elts) > 1 else None
            names = ["--" + kebab(stmt.target.id)]
            if isinstance(meta, ast.Call) and ast.unparse(meta.func) == "Arg":
                kw = {k.arg: k.value for k in meta.keywords}
                if "no_cli" in kw and isinstance(kw["no_cli"], ast.Constant) and kw["no_cli"].value:
                    continue
                if "cli_name" in kw and isinstance(kw["cli_name"], ast.Constant):
                    names = [kw["cli_name"].value]
                if "aliases" in kw and isinstance(kw["aliases"], (ast.List, ast.Tuple)):
                    names += [e.value for e in kw["aliases"].elts if isinstance(e, ast.Constant)]
            elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                continue  # no CLI metadata: not registered automatically
            out |= {n.lstrip("-") for n in names if n.startswith("--")}
    return out


def add_argument_flags(source: str) -> set[str]:
    """``--flag`` names of ``*.add_argument("--flag", ...)`` calls."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            out |= {a.value[2:] for a in node.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")}
    return out


def kebab(name: str) -> str:
    return name.replace("_", "-")


def extract(package: str, version: str, wheel: Path) -> dict:
    z = zipfile.ZipFile(wheel)

    def read(path: str) -> str:
        return z.read(path).decode("utf-8")

    info = {"engine": package, "version": version, "wheel": wheel.name,
            "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
            "extracted_by": "experiments/tools/extract_engine_args.py"}
    if package == "vllm":
        info["source"] = "vllm/engine/arg_utils.py: EngineArgs fields"
        info["flags"] = sorted(kebab(f) for f in dataclass_fields(read("vllm/engine/arg_utils.py"), "EngineArgs"))
        info["choices"] = {
            "kv-cache-dtype": literal_values(read("vllm/config/cache.py"), "CacheDType"),
            "scheduling-policy": literal_values(read("vllm/config/scheduler.py"), "SchedulerPolicy"),
        }
    elif package == "sglang":
        src = read("sglang/srt/server_args.py")
        flags = set(kebab(f) for f in dataclass_fields(src, "ServerArgs"))
        if flags:
            info["source"] = "sglang/srt/server_args.py: ServerArgs fields"
        else:
            info["source"] = ("sglang/srt/arg_groups/fields/*.py: A[T, Arg] fields; sglang/srt/server_args.py: "
                              "parser.add_argument flags")
            for name in sorted(z.namelist()):
                if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
                    flags |= annotated_cli_flags(read(name))
        flags |= add_argument_flags(src)
        info["flags"] = sorted(flags)
    else:
        raise SystemExit(f"unknown engine {package}")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", default="0.33.0", help="vLLM release (default 0.33.0)")
    ap.add_argument("--sglang", default="0.5.23", help="SGLang release (default 0.5.23)")
    ap.add_argument("--wheel-dir", type=Path, help="reuse wheels already downloaded here")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    a = ap.parse_args(argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for pkg, ver in (("vllm", a.vllm), ("sglang", a.sglang)):
            d = a.wheel_dir or Path(tmp)
            found = sorted(d.glob(f"{pkg}-{ver}-*.whl")) if a.wheel_dir else []
            wheel = found[0] if found else download_wheel(pkg, ver, d)
            info = extract(pkg, ver, wheel)
            out = a.out_dir / f"{pkg}.json"
            atomic_files.write_text(out, json.dumps(info, indent=1) + "\n")
            print(f"{out}: {len(info['flags'])} flags of {pkg} {ver}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
