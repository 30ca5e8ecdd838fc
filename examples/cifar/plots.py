"""Loss and accuracy per epoch as a PNG: one run's (train.py) or several runs' side by side (compare.py).

Both read the ``history`` of train.py's ``metrics.json``: one dict per epoch
with ``epoch``, ``train_loss``, ``train_accuracy``, ``test_loss`` and
``test_accuracy``. matplotlib is imported only when a figure is drawn (it is in
autodist's "examples" extra).

Example:
    >>> summary = json.load(open("out/metrics.json"))
    >>> plot_run(summary, "out/metrics.png")
    True
"""
from __future__ import annotations

import logging
from itertools import cycle
from typing import Sequence

Curve = tuple[str, list[int], list[float]]  # label, epochs, values
STYLES = ["-", "--", ":", "-."]


def _curve(label: str, history: Sequence[dict], key: str) -> Curve:
    return label, [h["epoch"] for h in history], [h[key] for h in history]


def draw(path: str, loss: Sequence[Curve], accuracy: Sequence[Curve], *, loss_title: str, accuracy_title: str,
         loss_label: str = "loss", accuracy_label: str = "accuracy (%)", title: str | None = None) -> None:
    """Two panels, loss on the left and accuracy on the right, one line per curve, saved as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, curves in ((loss_ax, loss), (acc_ax, accuracy)):
        for (label, epochs, values), style in zip(curves, cycle(STYLES)):
            ax.plot(epochs, values, style, label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    loss_ax.set(xlabel="epoch", ylabel=loss_label, title=loss_title)
    acc_ax.set(xlabel="epoch", ylabel=accuracy_label, title=accuracy_title)
    loss_ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_runs(results: Sequence[tuple[str, dict]], path: str) -> None:
    """compare.py's figure: every run's train loss and test accuracy, one line style per run."""
    draw(path, [_curve(label, r["history"], "train_loss") for label, r in results],
         [_curve(label, r["history"], "test_accuracy") for label, r in results],
         loss_title="train loss (mean over the epoch)", loss_label="train loss",
         accuracy_title=f"test accuracy, {results[0][1]['dataset']}", accuracy_label="test accuracy (%)")


def plot_run(summary: dict, path: str, log: logging.Logger | logging.LoggerAdapter | None = None) -> bool:
    """train.py's figure: one run's train and test loss, train and test accuracy.

    Returns:
        True once the PNG is written; False, with one log line saying why, when matplotlib is missing.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        (log or logging.getLogger(__name__)).warning("no plot written: matplotlib is not installed (%s); "
                                                     "pip install matplotlib", err)
        return False
    history = summary["history"]
    draw(path, [_curve("train", history, "train_loss"), _curve("test", history, "test_loss")],
         [_curve("train", history, "train_accuracy"), _curve("test", history, "test_accuracy")],
         loss_title="loss (train: mean over the epoch)", accuracy_title="accuracy",
         title=f"{summary['dataset']}, model {summary['model']}, {summary['ranks']} rank(s), mode {summary['mode']}")
    return True
