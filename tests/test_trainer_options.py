"""The Trainer's optional parts as small values: each refuses a wrong option when built, and the
0.1 spelling (flat keywords) still builds the same values, with a warning naming the new one."""
import warnings

import pytest

import colab_par
from colab_par.training.options import Checkpoints, Evaluation, Logs, grouped_legacy_options
from colab_par.training.trainer import Trainer


@pytest.mark.parametrize("build,message", [
    (lambda: Evaluation(None, every=5), "Evaluation\\(data=None\\)"),
    (lambda: Evaluation([1], every=0), "every=0 must be a positive integer"),
    (lambda: Checkpoints("ckpt", every=0), "every=0 must be a positive integer"),
    (lambda: Checkpoints("ckpt", on_failure="retry"), "on_failure='retry' is not one of raise, restart"),
    (lambda: Checkpoints("ckpt", on_failure="restart"), "pass every="),
    (lambda: Checkpoints("ckpt", every=2, max_restarts=-1), "max_restarts=-1"),
    (lambda: Logs(every=0), "every=0 must be a positive integer"),
])
def test_each_option_value_refuses_a_wrong_option_when_built(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_the_flat_keywords_build_the_same_values_with_a_warning():
    flat = dict(eval_data=[1], eval_every=2, eval_batches=3, ckpt_dir="c", ckpt_every=4, on_failure="restart",
                max_restarts=5, log_every=6, telemetry=False, log_dir="runs", loggers=[], profile_steps=(1, 2))
    with pytest.warns(DeprecationWarning, match="evaluation=Evaluation"):
        groups = grouped_legacy_options(flat, dict(evaluation=None, checkpoints=None, logs=None))
    assert groups == dict(evaluation=Evaluation([1], every=2, batches=3),
                          checkpoints=Checkpoints("c", every=4, on_failure="restart", max_restarts=5),
                          logs=Logs(every=6, telemetry=False, tensorboard="runs", loggers=(), profile_steps=(1, 2)))


def test_flat_keywords_keep_their_old_errors_and_unknown_ones_fail():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="ckpt_every is set but ckpt_dir is None"):
            grouped_legacy_options(dict(ckpt_every=2), {})
        with pytest.raises(ValueError, match="eval_data is set but eval_every is None"):
            grouped_legacy_options(dict(eval_data=[1]), {})
        with pytest.raises(TypeError, match="both given"):
            grouped_legacy_options(dict(log_every=2), dict(logs=Logs()))
    with pytest.raises(TypeError, match="unexpected keyword argument.*log_evry.*logs=Logs"):
        Trainer(None, [], steps=1, log_evry=2)


def test_the_public_api_names_the_option_values():
    assert (colab_par.Evaluation, colab_par.Checkpoints, colab_par.Logs) == (Evaluation, Checkpoints, Logs)
