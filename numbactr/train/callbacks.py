"""``hugectr.TrainingCallback``: hooks Model.fit calls (HugeCTR's include/training_callback.hpp).

Subclass it and pass instances as ``CreateSolver(training_callbacks=[...])``. In fit's iteration mode
(repeat_dataset=True), as HugeCTR's Model::fit does:

    on_training_start()                    before the first step
    on_eval_start(iter)                    before each evaluation (iter: the 0-based step just trained)
    on_eval_end(iter, {"AUC": ..., ...})   after it, with the metrics; True from any callback stops training
                                           (every callback's on_training_end(iter) is called, then fit returns)
    on_training_end(iter)                  after the last step (iter = max_iter - 1)

HugeCTR calls none of them in epoch mode (repeat_dataset=False) and none when the AUC target ends the run;
numbactr does the same. A method a subclass does not define is an error when fit calls it (HugeCTR's are
pure virtual).
"""
from __future__ import annotations


class TrainingCallback:
    """Base class of fit's hooks (module docstring). Override all four."""

    def on_training_start(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_training_start: a TrainingCallback must define it")

    def on_training_end(self, current_iter: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_training_end: a TrainingCallback must define it")

    def on_eval_start(self, current_iter: int) -> bool:
        raise NotImplementedError(f"{type(self).__name__}.on_eval_start: a TrainingCallback must define it")

    def on_eval_end(self, current_iter: int, eval_results: dict) -> bool:
        raise NotImplementedError(f"{type(self).__name__}.on_eval_end: a TrainingCallback must define it")
