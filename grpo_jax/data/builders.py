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

A malformed row (GSM8K line, MATH file) is a ``DataError`` naming the file and line. The
builder config ``skip_bad_rows`` skips and counts them instead; it is a separate prepared
dataset (``<name>/skip_bad_rows/<version>``), so a strict run never reuses data that was
prepared with rows silently left out. The counts are kept in the dataset's metadata
(``skipped_rows``: file or folder -> count) and reported by ``loading.build``.
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


STRICT, SKIP_BAD_ROWS = "strict", "skip_bad_rows"
_CONFIGS = [
    tfds.core.BuilderConfig(name=STRICT, description="A malformed row is a DataError."),
    tfds.core.BuilderConfig(name=SKIP_BAD_ROWS, description="Malformed rows are skipped and counted."),
]


def _find_dir(root: str, candidates: tuple[str, ...], marker: str) -> str:
    for sub in candidates:
        path = os.path.join(root, sub)
        if os.path.exists(os.path.join(path, marker)):
            return path
    raise DataError(
        f"{marker!r} not found in {root!r} (looked in {[c or '.' for c in candidates]}); "
        "put the official dataset files there or point data.data_dir at them"
    )


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """What both builders share: the strict / skip_bad_rows configs and the skip counter."""

    code_path = _CODE_PATH
    BUILDER_CONFIGS = _CONFIGS

    def _metadata(self) -> tfds.core.MetadataDict:
        return tfds.core.MetadataDict(skipped_rows={})

    def _bad_row(self, where: str, what: str, count_as: str) -> None:
        """Raise a DataError for the row at ``where`` (file:line), or count it under
        ``count_as`` (a file or folder) when the config skips bad rows."""
        if self.builder_config.name != SKIP_BAD_ROWS:
            raise DataError(f"{where}: {what}; fix or remove it, or set data.skip_bad_rows=true "
                            "to skip such rows")
        skipped = self.info.metadata["skipped_rows"]
        skipped[count_as] = skipped.get(count_as, 0) + 1


class Gsm8kLocal(_LocalBuilder):
    """GSM8K from the official ``train.jsonl`` / ``test.jsonl``."""

    name = "gsm8k_local"
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
            metadata=self._metadata(),
        )

    def _split_generators(self, dl_manager):
        root = _find_dir(
            os.fspath(dl_manager.manual_dir),
            ("", "data", os.path.join("grade_school_math", "data")),
            "train.jsonl",
        )
        paths = {split: os.path.join(root, f"{split}.jsonl") for split in ("train", "test")}
        for path in paths.values():
            if not os.path.isfile(path):
                raise DataError(f"{path!r} not found next to train.jsonl; GSM8K needs both "
                                "train.jsonl and test.jsonl")
        return {split: self._generate_examples(path) for split, path in paths.items()}

    def _generate_examples(self, path: str):
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    example = {"question": record["question"], "answer": record["answer"]}
                    if not all(isinstance(v, str) for v in example.values()):
                        raise TypeError("question and answer must be strings")
                except (ValueError, KeyError, TypeError) as err:
                    # json's own position counts within the line: report the file's line.
                    self._bad_row(f"{path}:{line_number + 1}",
                                  f"not a GSM8K row ({_describe(err)})", path)
                    continue
                yield line_number, example


class MathLocal(_LocalBuilder):
    """MATH (Hendrycks) from the official per-problem JSON files."""

    name = "math_local"
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
            metadata=self._metadata(),
        )

    def _split_generators(self, dl_manager):
        root = _find_dir(os.fspath(dl_manager.manual_dir), ("", "MATH"), "train")
        for split in ("train", "test"):
            split_dir = os.path.join(root, split)
            if not any(_problem_files(split_dir)):
                raise DataError(f"{split_dir!r} holds no <subject>/<id>.json problem files; "
                                f"{self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
        return {split: self._generate_examples(root, split) for split in ("train", "test")}

    def _generate_examples(self, root: str, split: str):
        split_dir = os.path.join(root, split)
        for key, path in _problem_files(split_dir):
            try:
                with open(path, encoding="utf-8") as f:
                    record = json.load(f)
                example = {"id": key, "problem": record["problem"], "solution": record["solution"],
                           "level": str(record.get("level", "")), "type": str(record.get("type", ""))}
                if not (isinstance(example["problem"], str) and isinstance(example["solution"], str)):
                    raise TypeError("problem and solution must be strings")
            except (ValueError, KeyError, TypeError) as err:
                line = getattr(err, "lineno", None)  # json.JSONDecodeError knows its line
                self._bad_row(f"{path}:{line}" if line else path,
                              f"not a MATH problem ({_describe(err)})", split_dir)
                continue
            yield key, example


def _problem_files(split_dir: str):
    """(``subject/id``, path) of each ``<split_dir>/<subject>/<id>.json``, in sorted order."""
    if not os.path.isdir(split_dir):
        return
    for subject in sorted(os.listdir(split_dir)):
        subject_dir = os.path.join(split_dir, subject)
        if not os.path.isdir(subject_dir):
            continue
        for filename in sorted(os.listdir(subject_dir)):
            if filename.endswith(".json"):
                yield f"{subject}/{filename[: -len('.json')]}", os.path.join(subject_dir, filename)


def _describe(err: Exception) -> str:
    if isinstance(err, KeyError):
        return f"missing field {err}"
    if isinstance(err, json.JSONDecodeError):
        return f"invalid JSON, {err.msg.lower()} column {err.colno}"
    return f"{type(err).__name__}: {err}"


BUILDERS = {"gsm8k": Gsm8kLocal, "math": MathLocal}
