"""TFDS builders for GSM8K and MATH that read the official files from a local folder.

Nothing is downloaded: the official files are placed in TFDS's ``manual_dir``.

GSM8K (github.com/openai/grade-school-math): ``train.jsonl`` and ``test.jsonl``, one JSON
object per line, ``{"question": str, "answer": str}``; ``answer`` is the worked solution
with calculator annotations ``<<48/2=24>>`` and a last line ``#### 72``. Found in the
manual dir itself or in ``data/`` or ``grade_school_math/data/`` below it.

MATH (Hendrycks et al., 2021): ``train/<subject>/<id>.json`` and ``test/<subject>/<id>.json``,
each ``{"problem", "level", "type", "solution"}``; the solution's last ``\\boxed{}`` is
the answer. Found in the manual dir itself or in ``MATH/`` below it.

Both builders are defined outside the TFDS package, so ``_info`` builds ``DatasetInfo``
directly. Text features come back from a data source as ``bytes``.
"""
from __future__ import annotations

import json
import os

import tensorflow_datasets as tfds
from etils import epath

from grpo_jax.errors import DataError


# TFDS locates a builder's source file through ``importlib_resources``, which is not a
# dependency here (and the lookup only serves to find a checksums file, which local
# builders do not have), so both builders say where their code is directly.
_CODE_PATH = tfds.core.utils.classproperty(classmethod(lambda cls: epath.Path(__file__)))


def _find_dir(root: str, candidates: tuple[str, ...], marker: str) -> str:
    for sub in candidates:
        path = os.path.join(root, sub)
        if os.path.exists(os.path.join(path, marker)):
            return path
    raise DataError(
        f"{marker!r} not found in {root!r} (looked in {[c or '.' for c in candidates]}); "
        "put the official dataset files there or point data.data_dir at them"
    )


class Gsm8kLocal(tfds.core.GeneratorBasedBuilder):
    """GSM8K from the official ``train.jsonl`` / ``test.jsonl``."""

    name = "gsm8k_local"
    code_path = _CODE_PATH
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Official GSM8K JSONL read from a local folder."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put train.jsonl and test.jsonl from github.com/openai/grade-school-math "
        "(grade_school_math/data/) in the manual dir."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Grade-school math word problems with worked solutions.",
            features=tfds.features.FeaturesDict(
                {"question": tfds.features.Text(), "answer": tfds.features.Text()}
            ),
            homepage="https://github.com/openai/grade-school-math",
        )

    def _split_generators(self, dl_manager):
        root = _find_dir(
            os.fspath(dl_manager.manual_dir),
            ("", "data", os.path.join("grade_school_math", "data")),
            "train.jsonl",
        )
        return {
            split: self._generate_examples(os.path.join(root, f"{split}.jsonl"))
            for split in ("train", "test")
        }

    def _generate_examples(self, path: str):
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    example = {"question": record["question"], "answer": record["answer"]}
                except (ValueError, KeyError, TypeError) as err:
                    raise DataError(
                        f"{path}:{line_number + 1}: not a GSM8K row ({type(err).__name__}: {err}); "
                        "fix or remove that line"
                    ) from None
                yield line_number, example


class MathLocal(tfds.core.GeneratorBasedBuilder):
    """MATH (Hendrycks) from the official per-problem JSON files."""

    name = "math_local"
    code_path = _CODE_PATH
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Official MATH JSON files read from a local folder."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Extract MATH.tar (github.com/hendrycks/math) so that the manual dir holds "
        "train/<subject>/<id>.json and test/<subject>/<id>.json (or MATH/train/...)."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(
            builder=self,
            description="Competition mathematics problems with LaTeX solutions.",
            features=tfds.features.FeaturesDict(
                {"id": text, "problem": text, "solution": text, "level": text, "type": text}
            ),
            homepage="https://github.com/hendrycks/math",
        )

    def _split_generators(self, dl_manager):
        root = _find_dir(os.fspath(dl_manager.manual_dir), ("", "MATH"), "train")
        return {split: self._generate_examples(root, split) for split in ("train", "test")}

    def _generate_examples(self, root: str, split: str):
        split_dir = os.path.join(root, split)
        for subject in sorted(os.listdir(split_dir)):
            subject_dir = os.path.join(split_dir, subject)
            if not os.path.isdir(subject_dir):
                continue
            for filename in sorted(os.listdir(subject_dir)):
                if not filename.endswith(".json"):
                    continue
                with open(os.path.join(subject_dir, filename), encoding="utf-8") as f:
                    record = json.load(f)
                key = f"{subject}/{filename[: -len('.json')]}"
                yield key, {
                    "id": key,
                    "problem": record["problem"],
                    "solution": record["solution"],
                    "level": str(record.get("level", "")),
                    "type": str(record.get("type", "")),
                }


BUILDERS = {"gsm8k": Gsm8kLocal, "math": MathLocal}
