"""The package's layers: a sub-package imports only the root modules and the packages below it.

`LAYERS` is the one place the order is written (the README's map follows it). Every import in
``grpo_jax/`` counts, those inside functions too: a lazy import upward is a cycle all the same.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_jax"

# Bottom to top. The root modules (config, errors, shapes, loops) are below every package and
# import none of them.
LAYERS = ("tools", "parallel", "text", "data", "tasks", "model", "checkpoints", "sampler", "eval", "rl", "aot", "cli")
ROOT_MODULES = ("config", "errors", "shapes", "loops")


def layer_of(module: str) -> int:
    """-1 for the root modules, else the index of the module's sub-package in LAYERS."""
    parts = module.split(".")
    assert parts[0] == "grpo_jax", module
    if len(parts) == 1 or parts[1] in ROOT_MODULES:
        return -1
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS, or move it")
    return LAYERS.index(parts[1])


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every grpo_jax import in a file: ``from grpo_jax.a import b`` gives
    ``grpo_jax.a.b`` when that is a module, else ``grpo_jax.a``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "grpo_jax"]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            if node.module and node.module.split(".")[0] == "grpo_jax":
                for a in node.names:
                    sub = node.module + "." + a.name
                    is_module = (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() or \
                        (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                    out.append((node.lineno, sub if is_module else node.module))
    return out


def upward_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        for line, target in imported(path):
            if layer_of(target) > layer_of(here):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {here} imports {target}")
    return found


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_no_package_imports_one_above_it():
    assert upward_imports() == []


@pytest.mark.parametrize("source, target, upward", [
    ("grpo_jax.model.lora", "grpo_jax.rl.trainer", True),
    ("grpo_jax.rl.trainer", "grpo_jax.model.lora", False),
    ("grpo_jax.config", "grpo_jax.tasks.modular", True),
    ("grpo_jax.tasks.modular", "grpo_jax.config", False),
    ("grpo_jax.cli.train", "grpo_jax.aot", False),
])
def test_the_order_reads_as_written(source, target, upward):
    assert (layer_of(target) > layer_of(source)) is upward


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from grpo_jax.rl import trainer\n    import grpo_jax.cli.train\n")
    assert imported(f) == [(2, "grpo_jax.rl.trainer"), (3, "grpo_jax.cli.train")]
