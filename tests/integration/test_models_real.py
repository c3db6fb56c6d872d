"""The embedded default model converts once, loads again in seconds and generates."""

import time

import pytest
import torch

from kvpop import models
from kvpop.models import MissingModelPackageError, load_model, model_summary

pytestmark = pytest.mark.integration


def test_embedded_smollm2_generates():
    try:
        models.default_gguf_path()
    except MissingModelPackageError as e:
        pytest.skip(str(e))
    model, tok = load_model(progress=True)  # converts once into the user cache if needed
    t = time.perf_counter()
    model, tok = load_model(progress=False)
    elapsed = time.perf_counter() - t
    print(f"second load of the embedded model: {elapsed:.2f} s")
    assert elapsed < 10
    s = model_summary(model.config)
    assert (s["model_type"], s["num_layers"], s["num_q_heads"], s["num_kv_heads"], s["head_dim"]) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    batch = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=10, do_sample=False)
    text = tok.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    print(repr(text))
    assert out.shape[1] > batch["input_ids"].shape[1] and text.strip()
