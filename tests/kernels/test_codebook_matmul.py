"""``squeezeserve::codebook_matmul`` against its reference (look up, then matmul), on the compiled kernel on a
GPU and under Triton's interpreter on CPU (conftest routes CPU tensors to the kernel)."""

import itertools

import pytest
import torch

from squeezeserve.kernels import codebook_layout as cl
from squeezeserve.kernels import functional as K
from squeezeserve.kernels import reference, registry
from squeezeserve.kernels.ops import codebook_matmul as cm
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops.launch import cdiv

# (M, N, K, group): one row (the FMA path), batched decode (tl.dot at BLOCK_M 16), a prefill-sized M; K a
# multiple of neither 8 nor 10 indices a word (a partial last word, a masked last tile), per channel and
# group codebooks (group 48: a K tile of 16 inside each group), split-K over several tiles.
SHAPES = [
    (1, 40, 576, 0), (5, 24, 200, 0), (16, 33, 96, 32), (2, 24, 144, 48), (70, 20, 128, 64), (1, 17, 90, 0),
    (1, 24, 384, 48),
]  # fmt: skip


def _weight(n: int, k: int, group: int, bits: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    groups = k // group if group else 1
    index = torch.randint(0, 1 << bits, (n, k))
    codebook = torch.randn(n, groups << bits).to(torch.float16)
    return cl.pack_indices(index, bits).to(device), codebook.to(device)


def _assert_workspace_clean() -> None:
    """No split-K partial sums or counts left in quant_matmul's workspace (which codebook_matmul shares)."""
    for ws, counts in qm._workspace.current.values():
        assert not ws.any() and not counts.any()


def _decode_weight(bits: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Llama-sized 4096 x 4096 weight, a codebook a channel: indices, codebook and the bf16 dense weight."""
    indices, codebook = _weight(4096, 4096, 0, bits, device)
    return indices, codebook, cl.dequantize(indices, codebook, 4096, None, bits).to(torch.bfloat16)


def _assert_product(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, m: int) -> None:
    """``y`` is x @ dense.T within bf16's rounding (a wrong index or split-K part is off by O(1))."""
    expected = (x @ dense.t()).float()
    rel = ((y.float() - expected).norm() / expected.norm()).item()
    assert rel < 1e-2, (m, rel)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES)
def test_codebook_matmul_matches_lookup_then_matmul(m, n, k, group, bits, dtype, device):
    indices, codebook = _weight(n, k, group, bits, device)
    x = torch.randn(m, k, device=device).to(dtype)
    y = K.codebook_matmul(x, indices, codebook, group, bits)
    with registry.triton_on_cpu(False):
        expected = reference.codebook_matmul(x.cpu().float(), indices.cpu(), codebook.cpu(), group, bits)
    assert y.dtype == dtype and y.shape == (m, n)
    # Both multiply the same weights (fp16 codebook values rounded to x's dtype) in fp32; they differ by the
    # summation order and the output rounding (fp16 ~5e-4, bf16 ~4e-3 relative). A wrong index, bit offset
    # or group is off by O(1).
    rel = ((y.float().cpu() - expected).norm() / expected.norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel


@pytest.mark.parametrize("cast", [False, True], ids=["fp16-codebook", "bf16-codebook"])
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize(("m", "n", "k", "group"), [s for s in SHAPES if s[0] == 1])
def test_word_wise_lut_kernel_matches_lookup_then_matmul(m, n, k, group, bits, cast, device):
    # _codebook_lut_kernel (one row): a tile of whole index words, one slot of every word at a time, weights
    # loaded from the codebook in memory; split-K over two parts of the words where there are enough.
    indices, codebook = _weight(n, k, group, bits, device)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    words = indices.shape[1]
    if cast:  # a codebook cast once to the activations' dtype: the same rounded weights
        codebook = codebook.to(torch.bfloat16)
    cfg = {"kernel": "lut", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_W": 8 if words > 16 else 16, "split": 2}
    y = cm.launch(x, indices, codebook, group, bits, cfg)
    dense = cl.dequantize(indices.cpu(), codebook.cpu(), k, group or None, bits).to(torch.bfloat16).float()
    expected = x.cpu().float() @ dense.T
    rel = ((y.float().cpu() - expected).norm() / expected.norm()).item()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel < 1e-2, rel
    _assert_workspace_clean()


@pytest.mark.parametrize("traced", [False, True])
def test_split_k_partials_meet_and_leave_the_workspace_clean(traced, device, monkeypatch):
    # As quant_matmul's: the self-cleaning workspace when eager, a zeroed fp32 output when torch may trace.
    if traced:
        monkeypatch.setattr(cm, "eager", lambda *tensors: False)
    indices, codebook = _weight(24, 512, 0, 4, device)
    dense = cl.dequantize(indices.cpu(), codebook.cpu(), 512, None, 4).float()
    for m in (1, 3, 3, 17):  # the FMA and tensor-core paths; the same shape twice reuses the workspace
        x = torch.randn(m, 512, device=device).to(torch.float16)
        y = K.codebook_matmul(x, indices, codebook, 0, 4)
        expected = x.cpu().float() @ dense.T
        assert ((y.cpu().float() - expected).norm() / expected.norm()).item() < 2e-3
    _assert_workspace_clean()


def test_codebook_matmul_reference_is_the_layout_dequantized():
    """The reference itself: every weight is its row's (group's) codebook value at its index."""
    index = torch.tensor([[0, 3, 1, 2] * 8, [2, 2, 0, 1] * 8])
    codebook = torch.arange(16, dtype=torch.float16).view(2, 8)  # 2 rows, 2 groups of 16 columns, E = 4
    # 2 bits is not a served width: build the 4-bit layout with indices < 4 and codebooks padded to 16.
    padded = torch.zeros(2, 32, dtype=torch.float16)
    padded[:, 0:4], padded[:, 16:20] = codebook[:, 0:4], codebook[:, 4:8]
    weight = cl.dequantize(cl.pack_indices(index, 4), padded, 32, 16, 4)
    expected = torch.stack([
        torch.cat([codebook[r, index[r, :16]], codebook[r, 4 + index[r, 16:]]]) for r in range(2)
    ])  # fmt: skip
    assert torch.equal(weight, expected)


def test_codebook_matmul_refuses_mismatched_tensors_with_the_reason(device):
    indices, codebook = _weight(8, 64, 0, 4, device)
    x = torch.randn(2, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"codebook must be \[8, 16\]"):
        K.codebook_matmul(x, indices, codebook[:, :8], 0, 4)
    with pytest.raises(ValueError, match="indices must be int32"):
        K.codebook_matmul(x, indices, codebook, 0, 3)  # 3 bits pack 10 a word: 7 words, not 8
    with pytest.raises(ValueError, match="multiple of 16"):
        K.codebook_matmul(x, indices, codebook, 24, 4)
    lut = {"kernel": "lut", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_W": 8, "split": 1}
    with pytest.raises(ValueError, match="LUT kernel takes one row, got 2"):
        cm.launch(x, indices, codebook, 0, 4, lut)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile traces the compiled kernels")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(("m", "k"), [(1, 64), (3, 64), (16, 4096)])
def test_codebook_matmul_under_torch_compile_computes_what_its_eager_calls_do(check, backend, m, k):
    # As quant_matmul's (test_quant_matmul.py): no output passed again as the unused workspace; and Inductor
    # copies the lookups' PTX into a source file of its own (a string with line breaks broke there).
    indices, codebook = _weight(64, k, 32, 4, "cuda")
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: torch.ops.squeezeserve.codebook_matmul(x, indices, codebook, 32, 4), backend=backend
    )
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    check.close(compiled(x), K.codebook_matmul(x, indices, codebook, 32, 4), torch.float16)


def test_codebook_matmul_op_schema_fake_and_autograd(check, device):
    indices, codebook = _weight(8, 64, 32, 4, device)
    x = torch.randn(3, 64, device=device, requires_grad=True)
    check.opcheck(torch.ops.squeezeserve.codebook_matmul, (x, indices, codebook, 32, 4))
    x16 = torch.randn(3, 64, device=device, dtype=torch.float16)
    check.opcheck(torch.ops.squeezeserve.codebook_matmul_opaque, (x16, indices, codebook, 32, 4))


def test_codebook_matmul_gradient_is_grad_times_weight(device):
    indices, codebook = _weight(8, 64, 0, 3, device)
    x = torch.randn(4, 64, device=device, requires_grad=True)
    K.codebook_matmul(x, indices, codebook, 0, 3).sum().backward()
    weight = cl.dequantize(indices.cpu(), codebook.cpu(), 64, None, 3).float()
    torch.testing.assert_close(x.grad.cpu(), weight.sum(0).expand(4, 64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k", "group", "block_k", "split"),
    [(24, 384, 0, 64, 2), (20, 200, 0, 64, 3), (24, 384, 48, 16, 4), (17, 512, 128, 128, 1)],
)  # fmt: skip
def test_fma_kernel_matches_lookup_then_matmul(n, k, group, block_k, split, dtype, device):
    # _codebook_fma_kernel (4 bits, one row) at explicit tiles: per channel and grouped codebooks (a table
    # rebuilt per K tile), a K that ends in a partial word and a partial tile (200), N tiles with masked rows,
    # split-K whose partials meet in the workspace.
    indices, codebook = _weight(n, k, group, 4, device)
    x = torch.randn(1, k, device=device).to(dtype)
    cfg = {"kernel": "fma", "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": block_k, "split": split}
    y = cm.launch(x, indices, codebook, group, 4, cfg)
    dense = cl.dequantize(indices.cpu(), codebook.cpu(), k, group or None, 4).to(dtype).float()
    expected = x.cpu().float() @ dense.T
    rel = ((y.float().cpu() - expected).norm() / expected.norm()).item()
    assert y.dtype == dtype and y.shape == (1, n)
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel
    _assert_workspace_clean()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_byte_table_lookup_is_exact(kernel, dtype, device):
    # A one-hot activation row picks one column of the weight: every output is a single product 1 * w, so
    # the kernel's looked-up value comes back bit for bit (compiled: the prmt PTX; interpreted: its
    # emulation). All 16 indices in every slot of a word, codebook values of both signs from 1e-4 to 1e4 (bf16
    # values inside fp16's normal range: the rounding to x's dtype is exact, which the interpreter's
    # truncating bf16 cast needs), per channel and in groups of 16.
    n, k = 32, 64
    index = (torch.arange(k)[None, :] + torch.arange(n)[:, None]) % 16
    scale = torch.logspace(-4, 4, 16).repeat(k // 16)
    codebook = (torch.randn(n, k) * scale).to(torch.bfloat16).to(torch.float16)
    indices = cl.pack_indices(index, 4).to(device)
    columns = [0, 5, 9, 18, 31, 36, 47, 63]
    x = torch.zeros(len(columns), k, dtype=dtype)
    x[torch.arange(len(columns)), columns] = 1
    for group in (0, 16):
        book = (codebook[:, :16] if group == 0 else codebook).to(device)
        dense = cl.dequantize(indices.cpu(), book.cpu(), k, group or None, 4).to(dtype)
        if kernel == "fma":
            cfg = {"kernel": "fma", "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 16, "split": 1}
            y = torch.cat([cm.launch(row[None].to(device), indices, book, group, 4, cfg) for row in x])
        else:
            cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "split": 1}
            y = cm.launch(x.to(device), indices, book, group, 4, cfg)
        assert torch.equal(y.cpu(), dense[:, columns].T), group


def test_fma_kernel_refuses_what_it_cannot_tile(device):
    indices, codebook = _weight(8, 64, 32, 4, device)
    x = torch.randn(1, 64, device=device, dtype=torch.float16)
    fma = {"kernel": "fma", "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 64, "split": 1}
    with pytest.raises(ValueError, match="groups of whole K tiles, got 4 bits, group 32, BLOCK_K 64"):
        cm.launch(x, indices, codebook, 32, 4, fma)
    with pytest.raises(ValueError, match="FMA kernel takes one row, got 2"):
        cm.launch(torch.cat([x, x]), indices, codebook, 32, 4, {**fma, "BLOCK_K": 32})


# The GPU's dispatch, run on whichever backend the tests have (compiled on CUDA, interpreted on CPU): what
# launch_config picks on an H100 (132 SMs) and an H100 PCIe (114) for the benchmark's decode shapes (K, full
# N), M = 1..16 and 3 or 4 bits, launched at a narrow N (two N tiles, the second partial) with the same K
# tiling, split-K and tiles per split. The shape-based tests above run the interpreter's small tiles, and on
# a GPU their small N and K give every program a single K tile; these are the multi-tile loops the H100 runs
# at 4096.
GPU_SMS = (132, 114)
DECODE_KN = [(4096, 4096), (4096, 14336)]  # (K, full N)


def _gpu_paths() -> list[tuple[int, int, dict]]:
    """(K, bits, config) for each distinct (K, bits, tiles, tiles per split, row path) the GPUs choose."""
    paths = {}
    for sms, (k, n_full), m, bits in itertools.product(GPU_SMS, DECODE_KN, range(1, 17), (3, 4)):
        cfg = cm.launch_config(m, n_full, k, 0, sms, bits)
        tiles = cdiv(cdiv(k, 32 // bits), cfg["BLOCK_W"]) if "BLOCK_W" in cfg else cdiv(k, cfg["BLOCK_K"])
        per_split = cdiv(tiles, cfg["split"])
        key = (k, bits, cfg.get("kernel"), cfg["BLOCK_N"], cfg.get("BLOCK_K"), per_split)
        paths.setdefault(key, (k, bits, cfg))
    return list(paths.values())


GPU_PATHS = _gpu_paths()


def test_gpu_dispatch_for_llama_decode():
    # On 132 SMs at K = N = 4096: one row at 4 bits takes the FMA kernel, 8 rows and 512 columns a program,
    # no split (512 programs); at 3 bits the LUT kernel (1024 programs of 4 rows: no split). 2..16 rows take
    # the tensor-core kernel with 128-wide K tiles, split 8 ways at 4 bits (4 tiles each: 512 programs) and 5
    # at 3 bits (7, 7, 7, 7 and 4 tiles); the split does not change with M. N = 14336 halves the 4-bit split.
    fma = {"kernel": "fma", "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "split": 1, "num_warps": 2,
           "num_stages": 3}  # fmt: skip
    assert cm.launch_config(1, 4096, 4096, 0, 132, 4) == fma
    assert cm.launch_config(1, 4096, 4096, 0, 132, 3) == {
        "kernel": "lut", "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_W": 64, "split": 1
    }  # fmt: skip
    for m in range(2, 17):
        for bits, split in ((4, 8), (3, 5)):
            assert cm.launch_config(m, 4096, 4096, 0, 132, bits) == {
                "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "split": split
            }  # fmt: skip
        assert cm.launch_config(m, 14336, 4096, 0, 132, 4)["split"] == 4
    assert cm.launch_config(1, 4096, 4096, 128, 132, 4)["BLOCK_K"] == 128  # inside one group
    assert cm.launch_config(1, 512, 14336, 0, 132, 4)["split"] == 5  # 64 programs: K split to fill it twice
    assert cm.launch_config(1, 512, 14336, 0, 132, 3)["split"] == 3
    assert {cfg.get("kernel") for _, _, cfg in GPU_PATHS} == {"fma", "lut", None}
    assert {cfg["split"] for _, _, cfg in GPU_PATHS} >= {1, 2, 4, 5, 8}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("k", "bits", "cfg"), GPU_PATHS, ids=lambda v: str(v) if isinstance(v, int) else
                         f"{v.get('kernel', 'mma')}-split{v['split']}")  # fmt: skip
def test_codebook_matmul_in_the_gpus_configuration(k, bits, cfg, dtype, device):
    n = cfg["BLOCK_N"] + max(4, cfg["BLOCK_N"] // 2)
    indices, codebook = _weight(n, k, 0, bits, device)
    # The kernel's own weights (codebook values rounded to x's dtype), so only the summation order and the
    # output rounding differ (see the first test); a wrong index or word is off by O(1).
    dense = cl.dequantize(indices.cpu(), codebook.cpu(), k, None, bits).to(dtype).float()
    for m in (1,) if cfg["BLOCK_M"] == 1 else (2, 16) if device == "cpu" else (2, 4, 16):
        x = torch.randn(m, k, device=device).to(dtype)
        y = cm.launch(x, indices, codebook, 0, bits, cfg)
        expected = x.cpu().float() @ dense.T
        rel = ((y.float().cpu() - expected).norm() / expected.norm()).item()
        assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), (m, rel)
    _assert_workspace_clean()


@pytest.mark.parametrize("bits", [4, 3])
def test_codebook_matmul_at_llama_decode_size_on_the_gpu(bits, device):
    # The benchmark's failing call, (M, N, K) = (4, 4096, 4096) at 3 bits, and the rows around it, in its
    # order (each M after the one before, on one workspace). Too big for the interpreter.
    if device != "cuda":
        pytest.skip("4096 x 4096 runs in seconds compiled, minutes interpreted")
    indices, codebook, dense = _decode_weight(bits, device)
    for m in range(1, 17):
        x = torch.randn(m, 4096, device=device, dtype=torch.bfloat16)
        # The same call again: a workspace left dirty shows on the next one, and a split-K read that misses
        # other programs' partial sums (1-35% of launches at 3-12 rows before 2026-11-23's fix) within 20.
        for _ in range(20):
            _assert_product(K.codebook_matmul(x, indices, codebook, 0, bits), x, dense, m)


@pytest.mark.parametrize("bits", [4, 3])
def test_the_opaque_op_in_a_cuda_graph_gives_each_inputs_product(bits, device):
    # As vLLM's decode graphs call it: codebook_matmul_opaque run eagerly first (its launch plan recorded),
    # then captured in a CUDA graph (the plan's launches captured, split-K partials meeting in the
    # workspace) and replayed on new inputs in the captured one's place: each replay their product, the
    # workspace left clean.
    if device != "cuda":
        pytest.skip("CUDA graphs")
    indices, codebook, dense = _decode_weight(bits, device)
    op = torch.ops.squeezeserve.codebook_matmul_opaque
    for m in (1, 4, 16):
        xs = [torch.randn(m, 4096, device=device, dtype=torch.bfloat16) for _ in range(3)]
        x_in = xs[0].clone()
        op(x_in, indices, codebook, 0, bits)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = op(x_in, indices, codebook, 0, bits)
        for x in xs:
            x_in.copy_(x)
            graph.replay()
            _assert_product(y, x, dense, m)
    _assert_workspace_clean()
