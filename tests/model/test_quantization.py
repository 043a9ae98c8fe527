"""int8 weight-only quantization (``--quantization int8``, ``kvserve.model.quant``).

The reference for an int8 model is the same checkpoint with each projection replaced by
its dequantized weights (``q · scale``), run in fp32 as a plain model: the ``dequant``
kernel must match it token for token. The default ``int8pack`` kernel feeds PyTorch's
int8 matmul bf16 activations, so it differs from that reference by bf16 rounding: its
teacher-forced log-probabilities stay within ``LOGPROB_TOL`` of the reference's, and its
greedy tokens equal the reference's except where the reference itself had a near-tie
(its top two within ``LOGPROB_TOL``), after which the two runs continue differently.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.capacity import estimate
from kvserve.lora import LoRARequest
from kvserve.model.config import ModelConfig
from kvserve.model.llama import CausalLM, Linear
from kvserve.model.quant import (
    PACK_ALIGN,
    WIDE_ROWS,
    Int8Weight,
    dequantize,
    int8pack_supported,
    quantize_rows,
)
from tests.support.checkpoints import CHECKPOINTS, make_prompts
from tests.support.cli_server import start_cli_server
from tests.support.peft_adapters import ALL_LINEAR, build_adapter

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
# Measured on the five test checkpoints: teacher-forced |Δ log-prob| of int8pack vs the
# dequantized reference is at most 0.03 nats; the bound leaves room for other CPUs.
LOGPROB_TOL = 0.1
PROJECTION = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
HAS_INT8PACK = int8pack_supported("cpu")


def dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose projections hold their int8 round trip, ``q · scale``."""
    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        for name, w in tensors.items():
            if PROJECTION.search(name):
                tensors[name] = dequantize(*quantize_rows(w), torch.float32).to(w.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


def int8_llm(model: Path, kernel: str, **kwargs: object) -> LLM:
    llm = LLM(str(model), dtype="float32", device="cpu", quantization="int8", **kwargs)  # type: ignore[arg-type]
    for module in _model(llm).modules():
        if isinstance(module, Linear):
            assert module.int8 is not None
            module.int8.kernel = kernel
    return llm


def _model(llm: LLM) -> CausalLM:
    return llm.engine.runner.model


def tokens(outputs: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [o.outputs[0].token_ids for o in outputs]


# ---- the format and the matmul ---------------------------------------------------------
def test_rows_are_symmetric_int8_with_bf16_scales() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen) * torch.rand(40, 1, generator=gen)
    w[3] = 0.0  # an all-zero row stays zero (no 0/0)
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and q.is_contiguous() and q.shape == w.shape
    assert scales.dtype == torch.bfloat16 and scales.shape == (40,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert not q[3].any() and float(scales[3]) == 0.0
    # Each weight is within half a step of its row's scale (clamping included).
    err = (dequantize(q, scales, torch.float32) - w).abs()
    assert bool((err <= scales.float()[:, None] * 0.5 + 1e-7).all())


@pytest.mark.parametrize(
    "kernel",
    [
        "dequant",
        pytest.param(
            "int8pack",
            marks=pytest.mark.skipif(not HAS_INT8PACK, reason="no _weight_int8pack_mm here"),
        ),
    ],
)
# 10 rows: PyTorch's int8 kernel; 64 (≥ WIDE_ROWS): weights dequantized for a dense matmul.
@pytest.mark.parametrize("rows", [10, 64])
def test_int8_matmul_error_bound(kernel: str, rows: int) -> None:
    assert 10 < WIDE_ROWS <= 64  # the two rows cases take the two paths
    gen = torch.Generator().manual_seed(1)
    n_out, n_in = 192, 256
    w = torch.randn(n_out, n_in, generator=gen) * 0.05
    bias = torch.randn(n_out, generator=gen)
    x = torch.randn(2, rows // 2, n_in, generator=gen)  # any leading shape
    layer = Int8Weight.from_weight(w, kernel)
    assert layer.kernel == kernel
    y = layer.linear(x, bias)
    assert y.shape == (2, rows // 2, n_out) and y.dtype == torch.float32

    # Against the fp32 weights: each weight is off by at most scale/2, so each output by
    # at most Σ|x|·scale/2 (plus bf16 rounding on the int8pack path).
    bound = x.abs().sum(-1, keepdim=True) * layer.scales.float() / 2
    exact = F.linear(x, w, bias)
    slack = 1.0 if kernel == "dequant" else 1.05
    assert bool(((y - exact).abs() <= bound * slack + 2e-2).all())
    rel = (y - exact).norm() / exact.norm()
    assert rel < 0.02, f"relative error {rel:.4f}"

    # Against its own dequantized weights: exact but for rounding (dequant) or for the
    # bf16 activations and output (int8pack; and on its dense path, bf16 weights).
    w_deq = layer.dequantize()
    if kernel == "dequant":
        torch.testing.assert_close(y, F.linear(x, w_deq, bias), rtol=1e-5, atol=1e-5)
    else:
        ref = F.linear(x.to(torch.bfloat16).float(), w_deq) + bias
        torch.testing.assert_close(y, ref, rtol=1 / 64, atol=2e-2)


def test_input_sizes_the_kernel_cannot_take_use_the_dense_path() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(24, 40, generator=gen)  # 40 inputs: not a multiple of PACK_ALIGN
    x = torch.randn(3, 41, generator=gen)[:, 1:]  # a strided view, too
    layer = Int8Weight.from_weight(w, "auto")
    assert 40 % PACK_ALIGN and layer.wide_rows == 0
    want = F.linear(x.to(layer.wide_dtype).float(), layer.dequantize(layer.wide_dtype).float())
    torch.testing.assert_close(layer.linear(x, None), want, rtol=1 / 64, atol=1e-2)


# ---- whole models ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_int8_model_matches_its_dequantized_weights(
    name: str,
    checkpoint_dir,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    ckpt = checkpoint_dir(name)
    prompts = make_prompts(transformers.AutoTokenizer.from_pretrained(ckpt), n=8)
    reference = LLM(str(dequantized_checkpoint(ckpt, tmp_path / "deq")), dtype="float32")
    want = reference.generate(prompts, GREEDY, use_tqdm=False)

    # The dequant kernel computes with exactly the reference's weights.
    llm = int8_llm(ckpt, "dequant")
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == tokens(want)
    if not HAS_INT8PACK:
        return

    # PyTorch's kernel: bf16 activations, so equal up to near-ties.
    for module in _model(llm).modules():
        if isinstance(module, Linear) and module.int8 is not None:
            module.int8.kernel = "int8pack"
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        ours, theirs = g.outputs[0].token_ids, w.outputs[0].token_ids
        if ours == theirs:
            continue
        i = next(j for j in range(MAX_TOKENS) if ours[j] != theirs[j])
        top = w.outputs[0].logprobs[i].top  # the reference's own top two there
        assert ours[i] in top, f"{name}: token {i} {ours[i]} not in the reference's top 2"
        assert top[theirs[i]] - top[ours[i]] <= LOGPROB_TOL, f"{name}: not a near-tie at {i}"
    ids = prompts[0] + want[0].outputs[0].token_ids
    delta = llm.engine.prompt_logprobs(ids) - reference.engine.prompt_logprobs(ids)
    assert float(delta.abs().max()) <= LOGPROB_TOL


def test_projections_take_a_quarter_of_their_fp32_bytes(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    ckpt = checkpoint_dir("llama")
    full, int8 = (_model(LLM(str(ckpt), dtype="float32", quantization=q)) for q in (None, "int8"))

    def projections(model: CausalLM) -> int:
        return sum(m.nbytes for m in model.modules() if isinstance(m, Linear))

    # fp32 4 bytes a weight; int8 1, plus a bf16 scale per row of 64 or 128 inputs.
    assert projections(int8) <= projections(full) * (1 / 4 + 2 / (4 * 64))
    saved = projections(full) - projections(int8)
    assert int8.weight_nbytes() == full.weight_nbytes() - saved  # nothing else changed
    # Embeddings, the LM head and the norms keep the model's dtype.
    assert int8.embed_tokens.dtype == torch.float32
    assert int8.lm_head is None or int8.lm_head.dtype == torch.float32


def test_the_calculator_counts_the_int8_bytes_the_engine_holds(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """``kvserve calc --quantization int8`` and the operator's status.capacity (both
    ``capacity.estimate``) size the weights as the engine stores them (bf16: no packed
    copies)."""
    ckpt = checkpoint_dir("qwen2")  # q/k/v biases and tied embeddings
    config = ModelConfig.from_file(ckpt)
    for quantization in (None, "int8"):
        model = _model(LLM(str(ckpt), dtype="bfloat16", quantization=quantization))
        report = estimate(config, dtype="bf16", quantization=quantization)
        assert report.weight_bytes == model.weight_nbytes()
    weights, rows = config.projection_params()
    int8 = [m.int8 for m in model.modules() if isinstance(m, Linear) and m.int8 is not None]
    assert weights == sum(w.q.numel() for w in int8) and rows == sum(w.q.shape[0] for w in int8)


def test_lora_adds_its_delta_to_the_int8_base(checkpoint_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ckpt = checkpoint_dir("llama")
    adapter = build_adapter(ckpt, tmp_path / "adapter", r=8, targets=ALL_LINEAR, seed=4)
    prompts = make_prompts(transformers.AutoTokenizer.from_pretrained(ckpt), n=4)
    lora = LoRARequest("a", str(adapter))
    # Half the requests under the adapter, half on the base model, in one batch.
    loras = [lora if i % 2 else None for i in range(len(prompts))]
    settings: dict[str, object] = {"enable_lora": True, "max_lora_rank": 8}
    deq = dequantized_checkpoint(ckpt, tmp_path / "deq")
    want = LLM(str(deq), dtype="float32", **settings).generate(  # type: ignore[arg-type]
        prompts, GREEDY, use_tqdm=False, lora_request=loras
    )
    got = int8_llm(ckpt, "dequant", **settings).generate(
        prompts, GREEDY, use_tqdm=False, lora_request=loras
    )
    assert tokens(got) == tokens(want)
    base = int8_llm(ckpt, "dequant").generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(got)[1::2] != tokens(base)[1::2], "the adapter must change the output"


def test_an_unknown_method_is_refused_by_name(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="quantization must be None or one of int8, got 'int4'"):
        LLM(str(checkpoint_dir("llama")), quantization="int4")


# ---- the server flag -------------------------------------------------------------------
def test_kvserve_serve_quantization_flag(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    ckpt = checkpoint_dir("llama")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    offline = LLM(str(ckpt), dtype="float32", quantization="int8")
    want = offline.generate(["the cache keeps"], params, use_tqdm=False)[0].outputs[0].text
    proc, url, _port = start_cli_server(ckpt, "--quantization", "int8")
    try:
        body = {"model": "m", "prompt": "the cache keeps", "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body | {"ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        proc.stop()
    bad = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--model", str(ckpt), "--quantization", "int4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2, bad.stderr
    assert "--quantization: invalid choice: 'int4'" in bad.stderr
