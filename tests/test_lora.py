"""LoRA adapters (csrc/context/specee-lora.h, `python -m specee.convert lora`): a tiny random Llama made with
transformers and a PEFT adapter written by hand (adapter_config.json + adapter_model.safetensors). The logits under an
adapter at scale s equal transformers' with the merged weights W + s alpha / r B A; scale 0 is the base model; two
adapters add; speculative greedy modes give plain greedy tokens under an adapter; bad files are refused with their
reason; the converter matches upstream's convert_lora_to_gguf.py and upstream llama-completion --lora gives our greedy
tokens (both skipped when upstream is not here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specee
from conftest import load_hf
from specee.convert.hf import convert_hf_to_gguf
from specee.convert.lora import convert_lora
from specee.convert.merge import merge_gguf
from test_cli import cli  # noqa: F401 (a fixture: llama-cli)
from test_cli import run as cli_run
from test_convert_cli import bpe_dir, bpe_gguf, eagle_state, upstream_binary  # noqa: F401 (bpe_*: fixtures)
from test_families import FAMILIES, llama_completion_tokens, save_family
from test_devices import rpc_server  # noqa: F401 (a fixture: a specee-rpc-server on 127.0.0.1)
from test_server import Server, call

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_LORA = Path(os.environ.get("SPECEE_UPSTREAM_CONVERT_LORA", ROOT.parent / "up" /
                                    "llama_cpp_python-0.3.36/vendor/llama.cpp/convert_lora_to_gguf.py"))
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj", "self_attn.qkv_proj", "mlp.gate_up_proj")  # the last two: phi3's fused
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64, 128, 5]
N_CTX = 128
# logits against transformers' (F32): the K cache is F16 here, which moves logits by a few 1e-3 (the base model's too)
TOL = dict(atol=1e-2, rtol=1e-3)


def write_peft(folder: Path, hf: torch.nn.Module, rank: int, alpha: float, seed: int, lm_head: bool = True) -> Path:
    """A PEFT LoRA folder for the model `hf`: lora_A [r, in], lora_B [out, r] (random, B not zero as PEFT starts it,
    so the adapter changes the output) for every projection of every layer, and the lm_head."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    targets = {n: m for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)
               and (n.endswith(MODULES) or (lm_head and n == "lm_head"))}
    for name, lin in targets.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = 0.12 * torch.randn(rank, lin.in_features, generator=g)
        tensors[f"base_model.model.{name}.lora_B.weight"] = 0.12 * torch.randn(lin.out_features, rank, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": False, "bias": "none",
        "target_modules": sorted({n.split(".")[-1] for n in targets})}))
    return folder


def merged(hf_dir: Path, adapters: list[tuple[Path, float]], load=load_hf) -> torch.nn.Module:
    """transformers' model with each adapter folder's pairs merged at scale s: W + s alpha / r B A."""
    model = load(hf_dir)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for folder, scale in adapters:
            cfg = json.loads((folder / "adapter_config.json").read_text())
            from safetensors.torch import load_file
            t = load_file(folder / "adapter_model.safetensors")
            for key in t:
                if key.endswith(".lora_A.weight"):
                    name = key[len("base_model.model."):-len(".lora_A.weight")]
                    b = t[key.replace("lora_A", "lora_B")]
                    modules[name].weight += scale * cfg["lora_alpha"] / cfg["r"] * (b @ t[key])
    return model


def logits_of(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor([tokens])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def base(bpe_gguf: Path) -> Path:  # noqa: F811
    """The adapters' base model: the tiny BPE Llama."""
    return bpe_gguf


@pytest.fixture(scope="module")
def peft(bpe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:  # noqa: F811
    """Two adapters: rank 4 alpha 8 on everything, rank 2 alpha 0 (llama.cpp: the scale alone) without the lm_head."""
    hf = load_hf(bpe_dir)
    root = tmp_path_factory.mktemp("peft")
    return write_peft(root / "a", hf, 4, 8.0, seed=1), write_peft(root / "b", hf, 2, 0.0, seed=2, lm_head=False)


@pytest.fixture(scope="module")
def ggufs(peft: tuple[Path, Path], base: Path) -> tuple[Path, Path]:
    a, b = peft
    convert_lora(a, base, a / "a.gguf", "f32", progress=False)
    convert_lora(b, base, b / "b.gguf", "f32", progress=False)
    return a / "a.gguf", b / "b.gguf"


def ours(base: Path, tokens: list[int], **kw) -> np.ndarray:
    m = specee.Model(base, n_ctx=N_CTX, n_threads=1, **kw)
    try:
        return m.eval(tokens, output="all")
    finally:
        m.close()


# ---- the runtime against transformers


@pytest.mark.parametrize("scale", [1.0, 0.5, -0.7])
def test_logits_equal_transformers_with_merged_weights(scale: float, base: Path, peft, ggufs,
                                                       bpe_dir: Path) -> None:  # noqa: F811
    want = logits_of(merged(bpe_dir, [(peft[0], scale)]), PROMPT)
    got = ours(base, PROMPT, lora_scaled=[(ggufs[0], scale)])
    plain = logits_of(load_hf(bpe_dir), PROMPT)
    assert np.abs(want - plain).max() > 0.3  # the adapter changes the output far beyond the tolerance
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mistral"])
def test_every_family_and_fused_projection_equals_transformers(family: str, tmp_path: Path) -> None:
    """Biases (qwen2), Q/K norms (qwen3), fused QKV and gate-up (phi3), Gemma's norms and soft-capping: the adapted
    projections as transformers merges them; the lm_head too where it is not tied to the embeddings."""
    save_family(family, tmp_path)
    hf = load_hf_any(tmp_path)
    base = tmp_path / "base.gguf"
    convert_hf_to_gguf(tmp_path, base, "f32", progress=False)
    tied = hf.config.tie_word_embeddings
    peft = write_peft(tmp_path / "peft", hf, 4, 8.0, seed=5, lm_head=not tied)
    convert_lora(peft, base, tmp_path / "lora.gguf", "f32", progress=False)
    tokens = PROMPT[:8]
    want = logits_of(merged(tmp_path, [(peft, 0.9)], load_hf_any), tokens)
    assert np.abs(want - logits_of(hf, tokens)).max() > 0.3
    np.testing.assert_allclose(ours(base, tokens, lora_scaled=[(tmp_path / "lora.gguf", 0.9)]), want, **TOL)


def load_hf_any(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def test_scale_zero_and_init_without_apply_are_the_base(base: Path, ggufs, bpe_dir: Path) -> None:  # noqa: F811
    plain = logits_of(load_hf(bpe_dir), PROMPT)
    np.testing.assert_allclose(ours(base, PROMPT), plain, **TOL)
    np.testing.assert_array_equal(ours(base, PROMPT, lora_scaled=[(ggufs[0], 0.0)]), ours(base, PROMPT))
    np.testing.assert_array_equal(ours(base, PROMPT, lora=[ggufs[0]], lora_init_without_apply=True),
                                  ours(base, PROMPT))


def test_two_adapters_at_once_and_alpha_zero(base: Path, peft, ggufs, bpe_dir: Path) -> None:  # noqa: F811
    """Adapter b has alpha 0: llama.cpp scales it by the user's scale alone, i.e. as alpha = r."""
    cfg_b = json.loads((peft[1] / "adapter_config.json").read_text())
    (peft[1] / "adapter_config.json").write_text(json.dumps({**cfg_b, "lora_alpha": cfg_b["r"]}))
    try:
        want = logits_of(merged(bpe_dir, [(peft[0], 0.8), (peft[1], 0.6)]), PROMPT)
    finally:
        (peft[1] / "adapter_config.json").write_text(json.dumps(cfg_b))
    got = ours(base, PROMPT, lora_scaled=[(ggufs[0], 0.8), (ggufs[1], 0.6)])
    np.testing.assert_allclose(got, want, **TOL)


def test_set_lora_changes_the_scales_and_clears_the_cache(base: Path, ggufs) -> None:
    m = specee.Model(base, n_ctx=N_CTX, n_threads=1, lora=[ggufs[0], ggufs[1]])
    assert [(a["id"], a["scale"], a["alpha"]) for a in m.lora_adapters] == [(0, 1.0, 8.0), (1, 1.0, 0.0)]
    assert m.lora_adapters[0]["n_weights"] == 2 * 7 + 1 and m.lora_adapters[1]["n_weights"] == 2 * 7
    both = m.eval(PROMPT, output="all")
    m.set_lora([0.0, 0.0])
    assert m.kv_n_used == 0  # the cache held K/V of the old scales
    np.testing.assert_array_equal(m.eval(PROMPT, output="all"), ours(base, PROMPT))
    m.kv_clear()
    m.set_lora([1.0, 1.0])
    np.testing.assert_array_equal(m.eval(PROMPT, output="all"), both)
    with pytest.raises(ValueError, match="one scale per LoRA adapter"):
        m.set_lora([1.0])
    with pytest.raises(ValueError, match="not finite"):
        m.set_lora([float("nan"), 1.0])


@pytest.mark.parametrize("mode", ["eagle", "ngram"])
def test_speculative_greedy_equals_plain_under_an_adapter(mode: str, base: Path, ggufs, bpe_dir: Path,  # noqa: F811
                                                         tmp_path: Path) -> None:
    """The draft head is not adapted; verification is, so greedy tokens are plain greedy's under the adapter."""
    path = base
    if mode == "eagle":
        cfg = json.loads((bpe_dir / "config.json").read_text())
        folder = tmp_path / "eagle"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        torch.save(eagle_state(cfg, seed=3), folder / "pytorch_model.bin")
        path = tmp_path / "base-eagle.gguf"
        merge_gguf(base, path, eagle=folder, eagle_type="f32", progress=False)
    m = specee.Model(path, n_ctx=N_CTX, n_threads=1, lora_scaled=[(ggufs[0], 0.7)])
    prompt = PROMPT * 3  # repeats for the n-gram drafts
    plain = m.generate_tokens(prompt, 24, mode="plain", temp=0, ignore_eos=True)
    m.kv_clear()
    fast = m.generate_tokens(prompt, 24, mode=mode, temp=0, ignore_eos=True)
    assert fast == plain
    m.set_lora([0.0])  # the cache is cleared: what follows is the base model's, in either mode
    base_tokens = m.generate_tokens(prompt, 24, mode=mode, temp=0, ignore_eos=True)
    assert base_tokens != plain
    fresh = specee.Model(path, n_ctx=N_CTX, n_threads=1)
    assert base_tokens == fresh.generate_tokens(prompt, 24, mode="plain", temp=0, ignore_eos=True)
    m.set_lora([0.7])
    assert m.generate_tokens(prompt, 24, mode=mode, temp=0, ignore_eos=True) == plain


def test_layers_on_an_rpc_server_are_adapted_there(base: Path, ggufs, rpc_server: str) -> None:  # noqa: F811
    """The adapter's matrices of the offloaded layers live on the RPC server beside their weights; the logits are the
    CPU's (layers 0-1 and the output there with -ngl 2 in llama.cpp's order; every one with -ngl -1)."""
    cpu = ours(base, PROMPT, lora_scaled=[(ggufs[0], 0.8), (ggufs[1], 0.5)])
    for ngl in (2, -1):
        got = ours(base, PROMPT, lora_scaled=[(ggufs[0], 0.8), (ggufs[1], 0.5)], rpc_servers=[rpc_server],
                   n_gpu_layers=ngl, offload_order="last")
        np.testing.assert_allclose(got, cpu, atol=1e-4, rtol=1e-4)


# ---- bad files


def rewrite(src: Path, dst: Path, drop: set[str] = frozenset(), fields: dict | None = None,
            tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of a GGUF adapter with keys dropped or changed and tensors replaced or added."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in drop or (fields and k in fields):
            continue
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for k, v in (fields or {}).items():
        w.add_key_value(k, v[0], v[1], sub_type=v[2] if len(v) > 2 else None)
    new = dict(tensors or {})
    for t in r.tensors:
        if t.name not in new:
            w.add_tensor(t.name, np.array(t.data))
    for name, data in new.items():
        if data is not None:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_bad_adapters_are_refused_with_their_reason(base: Path, ggufs, tmp_path: Path) -> None:
    a = ggufs[0]
    S = gguf.GGUFValueType.STRING
    q = "blk.0.attn_q.weight"
    cases = {
        "not an adapter": rewrite(a, tmp_path / "t.gguf", fields={"general.type": ("model", S)}),
        "adapter.type is 'ia3'": rewrite(a, tmp_path / "k.gguf", fields={"adapter.type": ("ia3", S)}),
        "not a float32": rewrite(a, tmp_path / "al.gguf", fields={"adapter.lora.alpha": ("8", S)}),
        "activated LoRA": rewrite(a, tmp_path / "alora.gguf", fields={"adapter.alora.invocation_tokens": (
            [5, 6], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)}),
        "which the model lacks": rewrite(a, tmp_path / "l.gguf", tensors={
            "blk.9.attn_q.weight.lora_a": np.zeros((4, 64), np.float32),
            "blk.9.attn_q.weight.lora_b": np.zeros((64, 4), np.float32)}),
        "another model": rewrite(a, tmp_path / "s.gguf", tensors={
            q + ".lora_a": np.zeros((4, 32), np.float32)}),
        "rank 3 but lora_b of rank 4": rewrite(a, tmp_path / "r.gguf", tensors={
            q + ".lora_a": np.zeros((3, 64), np.float32)}),
        "has lora_b but not lora_a": rewrite(a, tmp_path / "m.gguf", tensors={q + ".lora_a": None}),
        "neither a lora_a nor a lora_b": rewrite(a, tmp_path / "n.gguf", tensors={
            "blk.0.attn_q.weight.lora_c": np.zeros((4, 64), np.float32)}),
        "cannot read it as GGUF": tmp_path / "junk.gguf",
    }
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + os.urandom(64))
    arch = rewrite(a, tmp_path / "arch.gguf")
    data = arch.read_bytes()
    cases["architecture 'llamb'"] = tmp_path / "arch2.gguf"
    cases["architecture 'llamb'"].write_bytes(data.replace(b"llama", b"llamb", 1))
    for why, path in cases.items():
        with pytest.raises(specee.SpecEEError, match=why):
            specee.Model(base, n_ctx=N_CTX, n_threads=1, lora=[path])
    with pytest.raises(ValueError, match="lora_scaled"):
        specee.Model(base, n_ctx=N_CTX, n_threads=1, lora_scaled=[(a, float("inf"))])


def test_truncated_adapters_never_crash(base: Path, ggufs, tmp_path: Path) -> None:
    data = ggufs[0].read_bytes()
    for n in (8, 100, len(data) // 2, len(data) - 1):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(specee.SpecEEError):
            specee.Model(base, n_ctx=N_CTX, n_threads=1, lora=[cut])


FUZZ_WORKER = """
import sys
import specee
base, paths = sys.argv[1], sys.argv[2:]
for path in paths:
    try:
        m = specee.Model(base, n_ctx=64, n_threads=1, lora=[path])
        m.eval([1, 2, 3])
        m.close()
        print("loaded", flush=True)
    except specee.SpecEEError as e:
        print("refused", str(e).splitlines()[0][:80], flush=True)
"""


def test_fuzzed_adapters_are_refused_or_loaded_never_a_crash(base: Path, ggufs, tmp_path: Path) -> None:
    """Seeded mutations of an adapter file (bytes of its header, metadata and tensor infos set at random, words set to
    extremes, truncation) loaded one after another by a worker: each is refused with SpecEEError or loads and
    evaluates; a crash (or any other exception) ends the worker and fails the test."""
    data = ggufs[0].read_bytes()
    rng = np.random.default_rng(38)
    head = min(len(data), 4096)
    paths = []
    for i in range(120):
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 5))):
            at = int(rng.integers(0, head - 8))
            if rng.random() < 0.5:
                b[at] = int(rng.integers(0, 256))
            else:
                extreme = [0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1][int(rng.integers(0, 6))]
                b[at:at + 8] = extreme.to_bytes(8, "little")
        if rng.random() < 0.2:
            b = b[:int(rng.integers(0, len(b)))]
        paths.append(tmp_path / f"fuzz{i}.gguf")
        paths[-1].write_bytes(bytes(b))
    r = subprocess.run([sys.executable, "-c", FUZZ_WORKER, str(base), *map(str, paths)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == len(paths)
    assert any(line.startswith("refused") for line in lines)


# ---- the converter


def test_converter_layout_types_and_refusals(peft, base: Path, bpe_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    a = peft[0]
    out = tmp_path / "a-q8.gguf"
    convert_lora(a, bpe_dir, out, "q8_0", progress=False)  # the base as a Hugging Face folder
    r = gguf.GGUFReader(out)
    assert r.fields["general.type"].contents() == "adapter" and r.fields["adapter.type"].contents() == "lora"
    assert r.fields["adapter.lora.alpha"].contents() == 8.0
    t = {x.name: x for x in r.tensors}
    assert list(t["blk.0.ffn_down.weight.lora_a"].shape) == [160, 4]  # GGML order: [n_in, r]
    assert list(t["blk.0.ffn_down.weight.lora_b"].shape) == [4, 64]  # [r, n_out]
    assert t["blk.0.ffn_down.weight.lora_a"].tensor_type == gguf.GGMLQuantizationType.Q8_0  # rows of 160
    assert t["blk.0.ffn_down.weight.lora_b"].tensor_type == gguf.GGMLQuantizationType.F16  # rows of 4
    assert not list(tmp_path.glob("*.tmp"))
    cfg = json.loads((a / "adapter_config.json").read_text())
    bad = tmp_path / "rs"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes((a / "adapter_model.safetensors").read_bytes())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    with pytest.raises(ValueError, match="use_rslora"):
        convert_lora(bad, base, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="outtype"):
        convert_lora(a, base, tmp_path / "x.gguf", "q4_0")
    assert not list(tmp_path.glob("x.gguf*"))


def test_converter_cli(peft, base: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    r = subprocess.run([sys.executable, "-m", "specee.convert", "lora", str(peft[0]), "--base", str(base), "-o",
                        str(out), "--outtype", "f16"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert {t.tensor_type for t in gguf.GGUFReader(out).tensors} == {gguf.GGMLQuantizationType.F16}
    r = subprocess.run([sys.executable, "-m", "specee.convert", "lora", str(tmp_path), "--base", str(base), "-o",
                        str(tmp_path / "y.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "adapter_config.json" in r.stderr


# ---- the CLI


def test_cli_flags(cli: str, base: Path, ggufs, tmp_path: Path) -> None:
    """llama-cli's --lora (repeatable), --lora-scaled FNAME:SCALE and --lora-init-without-apply."""
    def go(*extra: str):
        return cli_run(cli, "-m", str(base), "-c", str(N_CTX), "-t", "1", "-n", "12", "--temp", "0", "--ignore-eos",
                       "-no-cnv", "-p", "hello world", *extra, timeout=120)

    plain, lora, scaled = go(), go("--lora", str(ggufs[0])), go("--lora-scaled", f"{ggufs[0]}:1")
    off = go("--lora", str(ggufs[0]), "--lora-init-without-apply")
    for r in (plain, lora, scaled, off):
        assert r.returncode == 0, r.stderr
    assert lora.stdout == scaled.stdout != plain.stdout
    assert off.stdout == plain.stdout
    two = go("--lora", str(ggufs[0]), "--lora", str(ggufs[1]))
    assert two.returncode == 0 and two.stdout != lora.stdout
    assert two.stdout == go("--lora", f"{ggufs[0]},{ggufs[1]}").stdout
    bad = go("--lora", str(tmp_path / "missing.gguf"))
    assert bad.returncode != 0 and "missing.gguf" in bad.stderr
    bad = go("--lora-scaled", str(ggufs[0]))
    assert bad.returncode != 0 and "lora_scaled" in bad.stderr


# ---- upstream


def upstream_adapter(peft_dir: Path, bpe_dir: Path, out: Path) -> Path:  # noqa: F811
    if not UPSTREAM_LORA.is_file():
        pytest.skip(f"upstream's convert_lora_to_gguf.py is not here ({UPSTREAM_LORA}; SPECEE_UPSTREAM_CONVERT_LORA)")
    r = subprocess.run([sys.executable, str(UPSTREAM_LORA), str(peft_dir), "--base", str(bpe_dir), "--outfile",
                        str(out), "--outtype", "f32"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ModuleNotFoundError" in r.stderr:
        pytest.skip(f"upstream's converter needs a package this environment lacks: {r.stderr.splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_converter_writes_upstreams_tensors(peft, ggufs, bpe_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    theirs = upstream_adapter(peft[0], bpe_dir, tmp_path / "up.gguf")
    t_up = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    r_ours = gguf.GGUFReader(ggufs[0])
    t_ours = {t.name: t for t in r_ours.tensors}
    assert sorted(t_ours) == sorted(t_up)
    for name, t in t_ours.items():
        assert t.tensor_type == t_up[name].tensor_type, name
        np.testing.assert_array_equal(np.array(t.data), np.array(t_up[name].data), err_msg=name)
    f_up = gguf.GGUFReader(theirs).fields
    for key in ("general.type", "adapter.type", "adapter.lora.alpha", "general.architecture"):
        assert r_ours.fields[key].contents() == f_up[key].contents(), key


@pytest.mark.upstream
def test_greedy_tokens_equal_upstream_llama_completion_lora(base: Path, ggufs, tmp_path: Path) -> None:
    exe = upstream_binary("llama-completion", "SPECEE_LLAMA_COMPLETION")
    text = "The quick brown fox, 12 and 4567 numbers"
    m = specee.Model(base, n_ctx=256, n_threads=2, type_v="f16", lora_scaled=[(ggufs[0], 0.5)])
    prompt = m.tokenize(text, parse_special=True)
    mine = [int(t) for t in m.generate_tokens(prompt, 32, mode="plain", temp=0, ignore_eos=True)]
    theirs = llama_completion_tokens(exe, base, text, 32, tmp_path, ["--lora-scaled", f"{ggufs[0]}:0.5"])
    assert theirs[:len(prompt)] == prompt
    assert mine == theirs[len(prompt):]
    plain = llama_completion_tokens(exe, base, text, 32, tmp_path)
    assert plain != theirs  # the adapter changes upstream's tokens too



# ---- the server


def test_server_lora_adapters_and_per_request_scales(base: Path, ggufs) -> None:
    """--lora / --lora-scaled, GET and POST /lora-adapters, a request's `lora` (adapters not listed at 0), 400 on a
    bad id or scale; requests under different scales at once each get what they get alone (one set at a time)."""
    s = Server(base, "-np", "2", "-c", "512", "--mode", "plain", "--ngram-cache", "0", "--lora", str(ggufs[0]),
               "--lora-scaled", f"{ggufs[1]}:0.5")
    try:
        listed = call(s.port, "GET", "/lora-adapters").json()
        assert [(a["id"], a["path"], a["scale"]) for a in listed] == [(0, str(ggufs[0]), 1.0), (1, str(ggufs[1]), 0.5)]

        def complete(lora=None) -> str:
            body = {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "ignore_eos": True}
            if lora is not None:
                body["lora"] = lora
            r = call(s.port, "POST", "/completion", body)
            assert r.status_code == 200, r.text
            return r.json()["content"]

        m = specee.Model(base, n_ctx=N_CTX, n_threads=1, lora_scaled=[(ggufs[0], 1.0), (ggufs[1], 0.5)])
        want = m.detokenize(m.generate_tokens(PROMPT, 16, mode="plain", temp=0, ignore_eos=True))
        m.set_lora([0.0, 0.0])
        want_off = m.detokenize(m.generate_tokens(PROMPT, 16, mode="plain", temp=0, ignore_eos=True))
        assert want != want_off
        default = complete()
        assert default == want
        off = complete([{"id": 0, "scale": 0.0}])  # adapter 1 not listed: 0 too
        assert off == want_off
        assert complete([{"id": 0, "scale": 1}, {"id": 1, "scale": 0.5}]) == default  # restores it
        assert complete([]) == default  # []: the server's scales
        with ThreadPoolExecutor(3) as pool:  # different scales at once: each as alone
            got = list(pool.map(complete, [None, [{"id": 0, "scale": 0}], None]))
        assert got == [default, off, default]
        for bad in ([{"id": 2, "scale": 1}], [{"id": "0", "scale": 1}], [{"id": 0, "scale": "x"}], [5], {"id": 0}):
            r = call(s.port, "POST", "/completion", {"prompt": "hi", "n_predict": 2, "lora": bad})
            assert r.status_code == 400 and "lora" in r.text, (bad, r.text)
        assert call(s.port, "POST", "/lora-adapters", [{"id": 1, "scale": 0}]).json() == {"success": True}
        assert [a["scale"] for a in call(s.port, "GET", "/lora-adapters").json()] == [0.0, 0.0]
        assert complete() == off
        assert call(s.port, "POST", "/lora-adapters", {"id": 0}).status_code == 400
        assert call(s.port, "POST", "/lora-adapters", [{"id": 9, "scale": 1}]).status_code == 400
    finally:
        s.stop()


def test_server_lora_init_without_apply_and_a_bad_file(base: Path, ggufs, tmp_path: Path) -> None:
    s = Server(base, "-np", "1", "-c", "256", "--lora", str(ggufs[0]), "--lora-init-without-apply")
    try:
        assert [a["scale"] for a in call(s.port, "GET", "/lora-adapters").json()] == [0.0]
    finally:
        s.stop()
    with pytest.raises(RuntimeError, match="missing.gguf"):
        Server(base, "--lora", str(tmp_path / "missing.gguf"))
