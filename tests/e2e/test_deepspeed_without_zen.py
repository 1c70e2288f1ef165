"""A DeepSpeed config whose section is misspelled: a warning at ``initialize``, no
start-up line, and ``engine.zen`` says why instead of DeepSpeed's generic AttributeError."""

import logging
import os

from tests.multiproc.launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")


def _worker(rank, world):
    import contextlib
    import io

    import torch

    import zen_ext.deepspeed
    from recipes.common import build_model

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("zen_ext").addHandler(handler)
    model = build_model(MODEL, seed=0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,
                                                                                           "torch_adam": True}},
           "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
           "zne": {"scheme": "auto", "dgc": {"enabled": True}}}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        engine, *_ = zen_ext.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randint(0, 1000, (2, 16))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    try:
        engine.zen.summary()
        error = None
    except AttributeError as exc:
        error = str(exc)
    other = None
    try:
        engine.no_such_attribute
    except AttributeError as exc:
        other = str(exc)
    return {"warnings": records, "stdout": stdout.getvalue(), "error": error, "getattr": getattr(engine, "zen", None),
            "other": other, "module_attr": engine.config is not None}


def test_misspelled_section_warns_and_engine_zen_says_why():
    (r,) = run_workers(_worker, 1, timeout_s=300)
    assert any('has "zne"; did you mean "zen"? Without it ZEN is NOT attached' in w for w in r["warnings"])
    assert "zen_ext: ZEN on" not in r["stdout"]  # no start-up line: ZEN is off
    assert r["error"].startswith("zen: ZEN is not attached to this DeepSpeedEngine: the config has no \"zen\" "
                                 "section (it has 'zne': a misspelling?); DeepSpeed's dense all-reduce synchronized")
    assert r["getattr"] is None  # the idiom code uses to run both ways
    assert r["other"] == "'DeepSpeedEngine' object has no attribute 'no_such_attribute'"  # other names unchanged
    assert r["module_attr"]
