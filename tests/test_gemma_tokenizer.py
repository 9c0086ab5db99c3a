"""Our Gemma tokenizer (sentencepiece .model and tokenizer.json) and chat template against Google's real
Gemma 2 and Gemma 3 tokenizers, read out of the maxtext wheel that `make setup` fetches into the machine's test
cache."""
from __future__ import annotations

import glob
import importlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from _skips import skip_setup
from trainer.gemma import tokenizer as tok_lib
from trainer.common.config import UsageError

WHEEL = "maxtext==0.2.5"
ASSETS = {"gemma2": "maxtext/assets/tokenizers/tokenizer.gemma", "gemma3": "maxtext/assets/tokenizers/tokenizer.gemma3"}
STRINGS = [
    "Hello world",
    "  leading spaces  and\ttabs\n\nnew lines",
    "naïve café 日本語 🤗 ½",
    "def f(x):\n    return x**2  # 12345",
    "<bos> typed by a user is text",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
]


def _cache_dir() -> str:
    """The machine-wide test cache's wheels (TPUCTL_TEST_CACHE, which conftest.py sets), where `make setup` puts
    the maxtext wheel."""
    return os.path.join(os.environ["TPUCTL_TEST_CACHE"], "wheels")


@pytest.fixture(scope="module")
def google_models(tmp_path_factory) -> dict[str, str]:
    """family -> path of Google's sentencepiece model (from the maxtext wheel; never committed). The suite fetches
    nothing itself: a missing wheel is setup's to fetch (a skip here, a failure on CI)."""
    cache = _cache_dir()
    wheels = glob.glob(os.path.join(cache, "maxtext-0.2.5-*.whl"))
    if not wheels:
        skip_setup(f"Google's tokenizers ({WHEEL}, which `make setup` downloads into {cache})")
    out = tmp_path_factory.mktemp("google-tokenizers")
    z = zipfile.ZipFile(wheels[0])
    paths = {}
    for fam, member in ASSETS.items():
        (out / fam).mkdir()
        paths[fam] = str(out / fam / "tokenizer.model")
        with open(paths[fam], "wb") as f:
            f.write(z.read(member))
    return paths


def _to_tokenizer_json(model: str, out: str) -> str:
    """tokenizer.json as Hugging Face's Gemma converter makes it from the same sentencepiece model."""
    import sentencepiece as spm
    conv = importlib.import_module("transformers.convert_slow_tokenizer")

    class Extractor(conv.GemmaSentencePieceExtractor):
        def __init__(self, m):  # this transformers release forgets to set .sp, which extract() reads
            super().__init__(m)
            self.sp = spm.SentencePieceProcessor(model_file=m)

    class Converter(conv.GemmaConverter):
        SpmExtractor = Extractor

    class Slow:
        vocab_file = model
        pad_token, eos_token, bos_token, unk_token = "<pad>", "<eos>", "<bos>", "<unk>"
        legacy, add_prefix_space = False, False

    Converter(Slow()).converted().save(out)
    return out


@pytest.fixture(scope="module")
def tokenizers(google_models) -> dict[tuple[str, str], tok_lib.GemmaTokenizer]:
    out = {}
    for fam, model in google_models.items():
        out[fam, "model"] = tok_lib.GemmaTokenizer(model)
        out[fam, "json"] = tok_lib.GemmaTokenizer(_to_tokenizer_json(model, model.replace(".model", ".json")))
    return out


@pytest.mark.parametrize("fmt", ["model", "json"])
@pytest.mark.parametrize("fam", ["gemma2", "gemma3"])
def test_ids_match_sentencepiece_with_googles_model(google_models, tokenizers, fam, fmt):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=google_models[fam])
    tok = tokenizers[fam, fmt]
    assert tok.vocab_size == sp.get_piece_size() == {"gemma2": 256000, "gemma3": 262144}[fam]
    assert (tok.bos_id, tok.eos_id) == (sp.bos_id(), sp.eos_id()) == (2, 1)
    assert tok.end_of_turn_id == sp.piece_to_id("<end_of_turn>") == {"gemma2": 107, "gemma3": 106}[fam]
    for s in STRINGS:
        ids = tok.encode(s)
        assert ids == [sp.bos_id(), *sp.encode(s)], s
        assert tok.decode(ids[1:]) == sp.decode(ids[1:]) == s
    assert tok.encode("<bos>", bos=False).count(sp.bos_id()) == 0  # BOS is an id, never text


@pytest.mark.parametrize("fmt", ["model", "json"])
@pytest.mark.parametrize("fam", ["gemma2", "gemma3"])
def test_chat_template_matches_sentencepiece_on_the_rendered_turns(google_models, tokenizers, fam, fmt):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=google_models[fam])
    tok = tokenizers[fam, fmt]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there! "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    text = ("<start_of_turn>user\nBe brief.\n\nHi there!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
            "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")
    assert tok_lib.chat_text(msgs) == text
    ids = tok.chat(msgs)
    assert ids == [sp.bos_id(), *sp.encode(text)]
    assert ids.count(sp.bos_id()) == 1 and ids.count(tok.end_of_turn_id) == 3
    assert ids[1] == sp.piece_to_id("<start_of_turn>")  # the marker is one piece, right after BOS


def test_chat_rejects_turns_out_of_order():
    with pytest.raises(UsageError, match="alternate"):
        tok_lib.chat_text([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(UsageError, match="unknown role 'tool'"):
        tok_lib.chat_text([{"role": "tool", "content": "a"}])


def test_a_tokenizer_that_does_not_fit_the_embedding_is_refused(google_models):
    root = os.path.dirname(google_models["gemma3"])
    assert tok_lib.load(root, embed_rows=262144).vocab_size == 262144
    with pytest.raises(UsageError, match=r"has 262144 pieces but the checkpoint's embedding has 256128 rows"):
        tok_lib.load(root, embed_rows=256128)  # a Gemma 3 tokenizer beside Gemma 2 weights
    assert tok_lib.load(os.path.dirname(google_models["gemma2"]), embed_rows=256128).vocab_size == 256000


def test_a_missing_wheel_is_setups_to_fetch(tmp_path):
    """With the cache empty, the tests that need Google's tokenizers skip naming what `make setup` fetches, fail on
    CI (CI=true), and fetch nothing themselves."""
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["TPUCTL_TEST_CACHE"] = str(tmp_path)
    outs = {}
    for ci in (None, "true"):
        e = {**env, **({"CI": ci} if ci else {})}
        outs[ci] = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-rA",
                                   "-q", str(here / "test_gemma_tokenizer.py"), "-k", "does_not_fit_the_embedding"],
                                  cwd=here.parent, env=e, capture_output=True, text=True, timeout=300)
    what = f"missing (`make setup` installs it): Google's tokenizers ({WHEEL}, which `make setup` downloads into " \
           f"{tmp_path / 'wheels'})"
    assert outs[None].returncode == 0 and "1 skipped" in outs[None].stdout and what in outs[None].stdout, \
        outs[None].stdout[-3000:]
    assert outs["true"].returncode == 1 and "1 error" in outs["true"].stdout, outs["true"].stdout[-3000:]
    assert f"on CI (CI=true) `make setup` has run, yet this test skipped: {what}" in outs["true"].stdout
    assert not glob.glob(str(tmp_path / "**" / "maxtext-*"), recursive=True)  # nothing fetched
