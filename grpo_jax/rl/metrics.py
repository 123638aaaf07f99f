"""Metrics: one JSONL line per logged step plus TensorBoard scalars, written by process 0 only."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

import numpy as np
from etils import epath

from grpo_jax.parallel.distributed import is_main_process


def to_python(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Device scalars → floats (NaN/Inf kept as strings JSON can hold)."""
    out = {}
    for k, v in metrics.items():
        v = float(np.asarray(v))
        out[k] = v if math.isfinite(v) else str(v)
    return out


class MetricsWriter:
    """Appends to `<run_dir>/metrics.jsonl` and `<run_dir>/tb/`. `truncate_after(step)` drops
    lines past a restored checkpoint so a resumed run's file reads like an uninterrupted one."""

    def __init__(self, run_dir: str, *, tensorboard: bool = True):
        # epath: the run dir may be gs:// on a pod slice.
        self.path = epath.Path(run_dir) / "metrics.jsonl"
        self.enabled = is_main_process()
        self._tb = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(epath.Path(run_dir) / "tb"))

    def truncate_after(self, step: int) -> None:
        if not self.enabled or not self.path.exists():
            return
        keep = [line for line in read_jsonl(self.path) if line.get("step", 0) <= step]
        with self.path.open("w") as f:
            for line in keep:
                f.write(json.dumps(line) + "\n")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        record = {**to_python({k: v for k, v in metrics.items() if k != "step"}), "step": int(step)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, float):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path) -> list[dict]:
    with epath.Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
