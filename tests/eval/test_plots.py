"""PNG plots: files are real PNGs of the documented size; the bar panel widens the figure."""
import struct

import pytest

import numpy as np

from grpo_jax.eval.plots import moving_average, plot_history, plot_runs


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot_runs_with_and_without_bars(tmp_path):
    curves = {"GRPO": [[0.1, 0.5, 0.7], [0.2, 0.4, 0.8]], "PPO": [[0.1, 0.3, 0.4]]}
    plain = plot_runs(curves, [0, 10, 20], str(tmp_path / "a.png"), ylabel="reward")
    both = plot_runs(curves, [0, 10, 20], str(tmp_path / "b.png"), ylabel="reward",
                     bars={"GRPO": 81.0, "PPO": 143.6}, bar_label="MiB")
    assert _png_size(plain) == (660, 440)  # 6 x 4 inches at 110 dpi
    assert _png_size(both) == (1155, 440)


def test_plot_runs_rejects_ragged_seeds(tmp_path):
    with pytest.raises(ValueError):
        plot_runs({"GRPO": [[0.1, 0.5], [0.2]]}, [0, 10], str(tmp_path / "c.png"), ylabel="r")


def test_plot_history_one_panel_per_key(tmp_path):
    history = [{"step": 0, "eval_accuracy": 0.5}] + [{"step": s, "reward_mean": s / 10} for s in range(1, 5)]
    path = plot_history(history, ["reward_mean", "eval_accuracy", "kl"], str(tmp_path / "h.png"))
    assert _png_size(path) == (int(4.5 * 3 * 110), int(3.4 * 110))


def test_moving_average_is_trailing_mean():
    rows = np.array([[1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 10.0, 0.0, 0.0]])
    expected = np.array([[1.0, 1.5, 2.0, 3.0, 4.0], [0.0, 0.0, 10 / 3, 10 / 3, 10 / 3]])
    np.testing.assert_allclose(moving_average(rows, 3), expected)
    np.testing.assert_array_equal(moving_average(rows, 1), rows)


def test_references_are_dashed_lines_whose_labels_carry_no_seed_count(tmp_path, monkeypatch):
    """A bar to clear is not a run: drawn as a run it was labelled "(n=1)"."""
    from grpo_jax.eval import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    plot_runs({"GRPO": [[0.1, 0.5], [0.2, 0.4]]}, [0, 10], str(tmp_path / "r.png"), ylabel="accuracy",
              references={"bar": 0.22})
    ax = figures[0].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["GRPO (n=2)", "bar"]
    bar = ax.get_lines()[-1]
    assert bar.get_linestyle() == "--" and list(bar.get_ydata()) == [0.22, 0.22]
