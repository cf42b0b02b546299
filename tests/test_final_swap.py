"""final/ (and best/, critic/) is replaced so that a reader always finds a complete directory: never a moment
with no final/ while a newer one is swapped in."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shifu.models.loading import load_causal_lm, load_tokenizer
from shifu.runs import files

pytestmark = pytest.mark.integration

READER = """
import os, sys, time
path, stop = sys.argv[1], sys.argv[2]
missing = seen = 0
while not os.path.exists(stop):
    seen += 1
    missing += not os.path.isfile(os.path.join(path, "config.json"))
print(missing, seen)
"""


def test_replacing_final_never_leaves_a_moment_without_it(tiny_model_dir, tmp_path, monkeypatch):
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    final = tmp_path / "final"
    files.save_hf_dir(model, tok, final)
    renames = []

    def watched_replace(src, dst):  # every rename the swap makes: is final/ there right after it?
        os.rename(src, dst)
        renames.append((os.path.basename(src), os.path.basename(dst), final.is_dir()))

    monkeypatch.setattr(files.os, "replace", watched_replace)
    files.save_hf_dir(model, tok, final)
    assert all(there for *_, there in renames), renames
    assert (final / "config.json").is_file() and not (tmp_path / ".tmp-final").exists()
    assert load_causal_lm(final).config.n_layer == model.config.n_layer


def test_a_reader_polling_final_never_misses_it(tiny_model_dir, tmp_path):
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    final, stop = tmp_path / "final", tmp_path / "stop"
    files.save_hf_dir(model, tok, final)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(final), str(stop)], stdout=subprocess.PIPE, text=True
    )
    try:
        time.sleep(0.5)
        for _ in range(20):
            files.save_hf_dir(model, tok, final)
    finally:
        stop.touch()
        out, _ = reader.communicate(timeout=60)
    missing, seen = map(int, out.split())
    assert seen > 0 and missing == 0, (missing, seen)
