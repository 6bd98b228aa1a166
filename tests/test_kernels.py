"""The CPU matmul kernels (csrc/base/specee-kernels.cpp, docs/kernels.md). Q8_0, Q4_K, Q5_K and Q6_K weights in the
file's layout times 1..n token rows give ggml's own vec_dot results bit for bit, on the SIMD path and on the portable
path forced on, for every row count, odd shapes and K not a multiple of 256. Q4_1, and the K-quants in the loader's
eight-row layout, have this runtime's own sums: the same bits for every row count, thread count, path and layout, and
within the float rounding of ggml's results. Q4_0 in the eight-row layout gives ggml's repacked GEMV's and GEMM's
bits for every row count. A model's logits are the same with kernels auto and portable (and off, where the bits are
ggml's), and a token's logits do not depend on how many tokens share its pass. SmolLM2 runs (real weights, greedy
identity of the lossless modes, perplexity) are marked slow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import specee
from specee import _core
from specee.convert.quantize import quantize_gguf

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14  # ggml's type ids
K_QUANTS = [Q4_K, Q5_K, Q6_K]
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}  # a super-block of 256
TYPES = [Q4_1, Q8_0]
AUTO, PORTABLE, OFF = 0, 1, 2  # enum specee_kernels_mode

# the paths a test can force here: the portable one always, the SIMD one where this machine has it
MODES = [PORTABLE] + ([AUTO] if _core.kernels_auto_path() != "off" else [])


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    diff = np.flatnonzero(bits(got) != bits(want))
    assert diff.size == 0, f"{what}: {diff.size} of {want.size} differ, e.g. {got.flat[diff[0]]!r} vs {want.flat[diff[0]]!r}"


def random_weights(k: int, m: int, seed: int, wtype: int = Q4_1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return _core.quantize(wtype, (rng.standard_normal((m, k)) * 0.1 + 0.02).astype(np.float32))


def mul_mat(w: np.ndarray, k: int, x: np.ndarray, mode: int, n_threads: int = 2, wtype: int = Q4_1,
            rows8: bool = False) -> np.ndarray:
    return _core.kernels_mul_mat(w, k, x, mode, n_threads, type=wtype, rows8=rows8)[0]


def one_at_a_time(w: np.ndarray, k: int, x: np.ndarray, mode: int, wtype: int) -> np.ndarray:
    """Each token alone: ggml's one-token vec_dot under OFF (and AUTO), the kernel's one-row tile under PORTABLE."""
    return np.concatenate([mul_mat(w, k, x[i:i + 1], mode, wtype=wtype) for i in range(x.shape[0])])


def dequantize_q4_1(w: np.ndarray, k: int) -> np.ndarray:
    """The weights a Q4_1 matrix stands for, in float64: per block of 32 d * q + m (ggml's block: d, m as fp16, then
    16 bytes, element i < 16 the low nibble of byte i, element 16 + i its high one)."""
    b = w.reshape(w.shape[0], k // 32, 20)
    d = b[:, :, 0:2].copy().view(np.float16).astype(np.float64)
    m = b[:, :, 2:4].copy().view(np.float16).astype(np.float64)
    q = np.concatenate([b[:, :, 4:] & 15, b[:, :, 4:] >> 4], axis=2).astype(np.float64)
    return (q * d + m).reshape(w.shape[0], k)


def assert_within_rounding(got: np.ndarray, ggml: np.ndarray, w: np.ndarray, k: int, x: np.ndarray, what: str) -> None:
    """Q4_1's kernel sums in another order than ggml's vec_dot: the results differ in the float rounding only, about
    1e-7 of sum |x| |w| (measured: at most 1.1e-7 on random weights, K = 64..4096); a wrong block, scale or min term
    moves them by about 1e-2 of it."""
    scale = np.abs(x.astype(np.float64)) @ np.abs(dequantize_q4_1(w, k)).T
    worst = float((np.abs(got.astype(np.float64) - ggml) / scale).max())
    assert worst < 1e-6, f"{what}: {worst:.2e} of sum |x| |w| from ggml's result"


# ---- one matmul against ggml's


# blocks of 32: K = 96, 288, 608 not multiples of 256; the K-quants' super-blocks of 256: K a multiple of 256
SHAPES = [(Q8_0, k, m) for k, m in [(64, 37), (96, 5), (288, 33), (608, 64), (32, 1)]] + [
    (t, k, m) for t in K_QUANTS for k, m in [(256, 37), (768, 5), (512, 1), (1536, 18)]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wtype,k,m", SHAPES)
def test_every_row_count_equals_ggml_bit_for_bit(mode: int, k: int, m: int, wtype: int) -> None:
    """n = 1..16 and past a tile (17, 33), rows not a multiple of anything; against ggml's mul_mat for the same n (Q8_0:
    llamafile's tinyBLAS from 2 rows; the K-quants: its vec_dot per pair, on the file's layout) and ggml's one-token
    vec_dot."""
    w = random_weights(k, m, seed=k + m, wtype=wtype)
    rng = np.random.default_rng(7)
    for n in list(range(1, 17)) + [17, 33]:
        x = rng.standard_normal((n, k)).astype(np.float32)
        got = mul_mat(w, k, x, mode, wtype=wtype)
        assert_same_bits(got, mul_mat(w, k, x, OFF, wtype=wtype), f"k={k} m={m} n={n}")
        if n in (2, 9, 16):
            assert_same_bits(got, one_at_a_time(w, k, x, OFF, wtype), f"k={k} m={m} n={n}, vs one token at a time")


# Q4_1: rows not a multiple of 8 (the file's layout only: a tile's last rows repeated), and multiples of 8 (also held
# in the eight-row layout)
Q4_1_SHAPES = [(64, 37), (96, 5), (288, 33), (608, 64), (32, 1), (64, 8), (160, 24)]


@pytest.mark.parametrize("k,m", Q4_1_SHAPES)
def test_q4_1_every_row_count_path_and_layout_give_the_same_bits(k: int, m: int) -> None:
    """n = 1..16 and past a tile (17, 33): the SIMD and portable paths, the file's layout and the eight-row one, each
    token's result bit for bit the portable path's for that token alone, and within rounding of ggml's."""
    w = random_weights(k, m, seed=k + m)
    rng = np.random.default_rng(7)
    x_all = rng.standard_normal((33, k)).astype(np.float32)
    alone = one_at_a_time(w, k, x_all, PORTABLE, Q4_1)
    layouts = [False, True] if m % 8 == 0 else [False]
    for n in list(range(1, 17)) + [17, 33]:
        x = x_all[:n]
        for mode in MODES:
            for rows8 in layouts:
                assert_same_bits(mul_mat(w, k, x, mode, rows8=rows8), alone[:n], f"k={k} m={m} n={n} mode {mode} "
                                 f"rows8 {rows8}")
        assert_within_rounding(alone[:n], mul_mat(w, k, x, OFF), w, k, x, f"k={k} m={m} n={n}")


def test_q4_1_eight_row_layout_goes_to_the_kernel_whatever_the_mode() -> None:
    """ggml's mul_mat cannot read the layout: with kernels off a matrix held in it still goes to the kernel."""
    k, m = 96, 16
    w = random_weights(k, m, seed=31)
    x = np.random.default_rng(32).standard_normal((3, k)).astype(np.float32)
    assert_same_bits(mul_mat(w, k, x, OFF, rows8=True), mul_mat(w, k, x, PORTABLE), "off, eight-row layout")
    with pytest.raises(ValueError):  # rows not a multiple of 8
        mul_mat(random_weights(k, 12, seed=1), k, x, AUTO, rows8=True)


@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("mode", MODES)
def test_a_row_s_result_does_not_depend_on_its_batch(mode: int, wtype: int) -> None:
    """Against one token at a time (Q8_0: ggml's one-token vec_dot; Q4_1: the kernel's portable path), from 2 rows
    past the switches: from 16 tokens auto hands Q8_0 to ggml's tinyBLAS (faster there), whose results, like the
    kernel's, are vec_dot's bit for bit."""
    k, m = 160, 21
    w = random_weights(k, m, seed=3, wtype=wtype)
    x = np.random.default_rng(11).standard_normal((130, k)).astype(np.float32)
    alone = one_at_a_time(w, k, x, OFF if wtype == Q8_0 else PORTABLE, wtype)
    for n in (2, 5, 8, 9, 15, 16, 17, 64, 130):
        assert_same_bits(mul_mat(w, k, x[:n], mode, wtype=wtype), alone[:n], f"n={n}")


@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_threads_split_rows_without_changing_results(n_threads: int, wtype: int) -> None:
    k, m = 128, 19
    w = random_weights(k, m, seed=5, wtype=wtype)
    x = np.random.default_rng(2).standard_normal((6, k)).astype(np.float32)
    want = mul_mat(w, k, x, OFF if wtype == Q8_0 else PORTABLE, 1, wtype=wtype)
    for mode in MODES:
        assert_same_bits(mul_mat(w, k, x, mode, n_threads, wtype=wtype), want, f"mode {mode}, {n_threads} threads")


@pytest.mark.parametrize("wtype", TYPES)
def test_extreme_activations_match_ggml(wtype: int) -> None:
    """Zeros, one large value per block, and constant rows: ggml's quantizer's edge cases go through unchanged."""
    k, m = 96, 7
    w = random_weights(k, m, seed=9, wtype=wtype)
    x = np.zeros((4, k), dtype=np.float32)
    x[1, ::32] = 1e4
    x[2] = 3.0
    x[3] = -np.linspace(0, 50, k, dtype=np.float32)
    want = mul_mat(w, k, x, OFF if wtype == Q8_0 else PORTABLE, wtype=wtype)
    for mode in MODES:
        assert_same_bits(mul_mat(w, k, x, mode, wtype=wtype), want, f"mode {mode}")
    if wtype == Q4_1:
        nonzero = np.abs(x).sum(axis=1) > 0
        assert_within_rounding(want[nonzero], mul_mat(w, k, x, OFF)[nonzero], w, k, x[nonzero], "extremes")
        assert (want[~nonzero] == 0).all()


def test_q8_0_weights_of_minus_128_match_ggml() -> None:
    """ggml's quantizer never writes -128, another tool's file may: |x| = 128 still fits maddubs' unsigned operand
    and no pair sum overflows int16, so the kernel's integers stay exact, as ggml's vec_dot's."""
    k, m = 64, 9
    w = random_weights(k, m, seed=12, wtype=Q8_0).reshape(m, -1, 34).copy()
    w[:, :, 2::3] = 0x80  # every third quant of every block -128
    w = w.reshape(m, -1)
    x = np.random.default_rng(13).standard_normal((5, k)).astype(np.float32) * 4
    for mode in MODES:
        assert_same_bits(mul_mat(w, k, x, mode, wtype=Q8_0), one_at_a_time(w, k, x, OFF, Q8_0), f"mode {mode}")


# ---- the K-quants (super-blocks of 256: K a multiple of 256)


@pytest.mark.parametrize("wtype", K_QUANTS)
def test_k_quant_any_block_bits_match_ggml(wtype: int) -> None:
    """Blocks of random bytes (every quant, every 6- or 8-bit sub-block scale and min) with sane super-block scales:
    the kernel's integer lanes stay exact as ggml's, for any file's blocks, not only those ggml's quantizer writes."""
    k, m, size = 512, 11, BLOCK_BYTES[wtype]
    rng = np.random.default_rng(21)
    w = rng.integers(0, 256, (m, k // 256, size), dtype=np.uint8)
    half = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    if wtype == Q6_K:
        w[:, :, 208:210] = half  # d
    else:
        w[:, :, 0:2] = half  # d
        w[:, :, 2:4] = half  # dmin
    w = w.reshape(m, -1)
    x = rng.standard_normal((9, k)).astype(np.float32) * 3
    for mode in MODES:
        assert_same_bits(mul_mat(w, k, x, mode, wtype=wtype), one_at_a_time(w, k, x, OFF, wtype), f"mode {mode}")


@pytest.mark.parametrize("wtype", K_QUANTS)
@pytest.mark.parametrize("n_threads", [1, 3])
def test_k_quant_batch_and_threads_do_not_change_a_row(n_threads: int, wtype: int) -> None:
    k, m = 256, 29
    w = random_weights(k, m, seed=23, wtype=wtype)
    x = np.random.default_rng(24).standard_normal((70, k)).astype(np.float32)
    alone = one_at_a_time(w, k, x, OFF, wtype)
    for mode in MODES:
        for n in (2, 8, 13, 70):
            got = _core.kernels_mul_mat(w, k, x[:n], mode, n_threads, type=wtype)[0]
            assert_same_bits(got, alone[:n], f"mode {mode}, n={n}, {n_threads} threads")


def dequantize_q4_k(w: np.ndarray, k: int) -> np.ndarray:
    """The weights a Q4_K matrix stands for, in float64: per sub-block s of 32, d * sc[s] * q - dmin * mn[s] (ggml's
    super-block: d, dmin as fp16, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles, sub-block 2j the low nibbles
    of bytes 32j..32j+31, 2j + 1 their high ones)."""
    b = w.reshape(w.shape[0], k // 256, 144)
    d = b[:, :, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = b[:, :, 2:4].copy().view(np.float16).astype(np.float64)
    s = b[:, :, 4:16].astype(np.int64)
    sc = np.concatenate([s[:, :, 0:4] & 63, (s[:, :, 8:12] & 15) | ((s[:, :, 0:4] >> 6) << 4)], axis=2)
    mn = np.concatenate([s[:, :, 4:8] & 63, (s[:, :, 8:12] >> 4) | ((s[:, :, 4:8] >> 6) << 4)], axis=2)
    qs = b[:, :, 16:].reshape(w.shape[0], k // 256, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(w.shape[0], k // 256, 8, 32).astype(np.float64)
    return (d[..., None] * sc[..., None] * q - dmin[..., None] * mn[..., None]).reshape(w.shape[0], k)


@pytest.mark.parametrize("k,m", [(256, 8), (512, 24), (1536, 16)])
def test_q4_k_eight_row_layout_every_row_count_path_and_thread_give_the_same_bits(k: int, m: int) -> None:
    """Q4_K held in the eight-row layout (this runtime's own sums): n = 1..16 and 17, the SIMD and portable paths,
    1 and 3 threads, each token's result bit for bit the portable path's for that token alone, and within rounding
    of ggml's vec_dot."""
    w = random_weights(k, m, seed=k + m, wtype=Q4_K)
    rng = np.random.default_rng(8)
    x_all = rng.standard_normal((17, k)).astype(np.float32)
    alone = np.concatenate([mul_mat(w, k, x_all[i:i + 1], PORTABLE, wtype=Q4_K, rows8=True) for i in range(17)])
    scale = np.abs(x_all.astype(np.float64)) @ np.abs(dequantize_q4_k(w, k)).T
    for n in list(range(1, 17)) + [17]:
        x = x_all[:n]
        for mode in MODES + [OFF]:  # a matrix in the layout goes to the kernel whatever the mode
            for n_threads in (1, 3):
                got = _core.kernels_mul_mat(w, k, x, mode, n_threads, type=Q4_K, rows8=True)[0]
                assert_same_bits(got, alone[:n], f"k={k} m={m} n={n} mode {mode}, {n_threads} threads")
        worst = float((np.abs(alone[:n] - mul_mat(w, k, x, OFF, wtype=Q4_K)) / scale[:n]).max())
        assert worst < 1e-6, f"k={k} m={m} n={n}: {worst:.2e} of sum |x| |w| from ggml's result"


def test_q4_k_eight_row_layout_takes_any_block() -> None:
    """Blocks of random bytes (every nibble, every 6-bit scale and min) with sane super-block scales: the integer sums
    stay exact (the SIMD path's int16 sums of eight byte products bounded by 8 * 2 * 15 * 128 < 2^15)."""
    k, m = 512, 16
    rng = np.random.default_rng(22)
    w = rng.integers(0, 256, (m, k // 256, 144), dtype=np.uint8)
    w[:, :, 0:2] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    w[:, :, 2:4] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    w = w.reshape(m, -1)
    x = rng.standard_normal((9, k)).astype(np.float32) * 3
    want = mul_mat(w, k, x, PORTABLE, wtype=Q4_K, rows8=True)
    for mode in MODES:
        assert_same_bits(mul_mat(w, k, x, mode, wtype=Q4_K, rows8=True), want, f"mode {mode}")
    scale = np.abs(x.astype(np.float64)) @ np.abs(dequantize_q4_k(w, k)).T
    assert float((np.abs(want - mul_mat(w, k, x, OFF, wtype=Q4_K)) / scale).max()) < 1e-6


REPACKS_Q4_0 = _core.kernels_auto_path() != "off"  # ggml's 8x8 Q4_0 layout needs AVX2, as auto's path does


@pytest.mark.parametrize("k,m", [(64, 8), (288, 24), (1536, 16)])
def test_q4_0_eight_row_layout_gives_ggml_s_repacked_bits(k: int, m: int) -> None:
    """Q4_0 held in the eight-row layout: n = 1..17 and 33, the SIMD and portable paths, 1 and 3 threads, bit for bit
    ggml's repacked Q4_0 (its one-token GEMV and its GEMM from 4 tokens, which agree), so a token's result does not
    depend on its batch and plain decoding keeps upstream's bits."""
    w = random_weights(k, m, seed=k + m, wtype=Q4_0)
    x_all = np.random.default_rng(9).standard_normal((33, k)).astype(np.float32)
    alone = np.concatenate([mul_mat(w, k, x_all[i:i + 1], PORTABLE, wtype=Q4_0, rows8=True) for i in range(33)])
    for n in list(range(1, 18)) + [33]:
        x = x_all[:n]
        for mode in MODES + [OFF]:  # a matrix in the layout goes to the kernel whatever the mode
            for n_threads in (1, 3):
                got = _core.kernels_mul_mat(w, k, x, mode, n_threads, type=Q4_0, rows8=True)[0]
                assert_same_bits(got, alone[:n], f"k={k} m={m} n={n} mode {mode}, {n_threads} threads")
        if REPACKS_Q4_0:
            assert_same_bits(alone[:n], mul_mat(w, k, x, OFF, wtype=Q4_0), f"k={k} m={m} n={n}: ggml's repacked")


@pytest.mark.parametrize("k,m", [(64, 37), (288, 24), (576, 9)])
def test_q4_0_in_the_file_s_layout_gives_the_eight_row_layout_s_bits(k: int, m: int) -> None:
    """Q4_0 left in the file's layout (a tied embedding the lm_head reads, rows not a multiple of 8): the tile
    transposes eight rows' blocks as it goes and gives the same bits as the eight-row layout and ggml's repacked Q4_0
    (m a multiple of 8), for n = 1..17, both paths, 1 and 3 threads; rows beyond the last multiple of 8 too."""
    w = random_weights(k, m, seed=k * m, wtype=Q4_0)
    x_all = np.random.default_rng(11).standard_normal((17, k)).astype(np.float32)
    alone = np.concatenate([mul_mat(w, k, x_all[i:i + 1], PORTABLE, wtype=Q4_0) for i in range(17)])
    m8 = m // 8 * 8
    if m8:  # the rows of whole groups of eight: the eight-row layout's bits
        assert_same_bits(alone[:, :m8], mul_mat(w[:m8], k, x_all, PORTABLE, wtype=Q4_0, rows8=True), "rows8")
    for n in range(1, 18):
        for mode in MODES:
            for n_threads in (1, 3):
                got = _core.kernels_mul_mat(w, k, x_all[:n], mode, n_threads, type=Q4_0, rows8=False)[0]
                assert_same_bits(got, alone[:n], f"k={k} m={m} n={n} mode {mode}, {n_threads} threads")
    if REPACKS_Q4_0 and m == m8:
        assert_same_bits(alone, mul_mat(w, k, x_all, OFF, wtype=Q4_0), "ggml's repacked")


def test_q4_0_eight_row_layout_takes_any_block() -> None:
    """Blocks of random bytes (every nibble) and large activations: the int16 sums of eight byte products stay exact
    (at most 8 * 2 * 15 * 127) and so does the nibbles' dot minus 8 times the quants' sum."""
    k, m = 256, 16
    rng = np.random.default_rng(23)
    w = rng.integers(0, 256, (m, k // 32, 18), dtype=np.uint8)
    w[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    w = w.reshape(m, -1)
    x = rng.standard_normal((9, k)).astype(np.float32) * 50
    want = mul_mat(w, k, x, PORTABLE, wtype=Q4_0, rows8=True)
    for mode in MODES:
        assert_same_bits(mul_mat(w, k, x, mode, wtype=Q4_0, rows8=True), want, f"mode {mode}")
    if REPACKS_Q4_0:
        assert_same_bits(want, mul_mat(w, k, x, OFF, wtype=Q4_0), "ggml's repacked")


def dequantize(w: np.ndarray, k: int, wtype: int) -> np.ndarray:
    """The weights a matrix stands for, in float64, by the gguf package's own dequantizer (an independent one)."""
    import gguf

    return gguf.quants.dequantize(w, gguf.GGMLQuantizationType(wtype)).astype(np.float64).reshape(w.shape[0], k)


@pytest.mark.parametrize("wtype", [Q5_K, Q6_K])
@pytest.mark.parametrize("k,m", [(256, 8), (512, 24), (1536, 16)])
def test_q5_k_q6_k_eight_row_layouts_every_row_count_path_and_thread_give_the_same_bits(k: int, m: int,
                                                                                       wtype: int) -> None:
    """Q5_K and Q6_K held in their eight-row layouts (this runtime's own sums): n = 1..17, the SIMD and portable
    paths, 1 and 3 threads, each token's result bit for bit the portable path's for that token alone, and within
    rounding of ggml's vec_dot."""
    w = random_weights(k, m, seed=k + m, wtype=wtype)
    x_all = np.random.default_rng(10).standard_normal((17, k)).astype(np.float32)
    alone = np.concatenate([mul_mat(w, k, x_all[i:i + 1], PORTABLE, wtype=wtype, rows8=True) for i in range(17)])
    scale = np.abs(x_all.astype(np.float64)) @ np.abs(dequantize(w, k, wtype)).T
    for n in range(1, 18):
        x = x_all[:n]
        for mode in MODES + [OFF]:  # a matrix in the layout goes to the kernel whatever the mode
            for n_threads in (1, 3):
                got = _core.kernels_mul_mat(w, k, x, mode, n_threads, type=wtype, rows8=True)[0]
                assert_same_bits(got, alone[:n], f"k={k} m={m} n={n} mode {mode}, {n_threads} threads")
        worst = float((np.abs(alone[:n] - mul_mat(w, k, x, OFF, wtype=wtype)) / scale[:n]).max())
        assert worst < 1e-6, f"k={k} m={m} n={n}: {worst:.2e} of sum |x| |w| from ggml's result"


@pytest.mark.parametrize("wtype", [Q5_K, Q6_K])
def test_q5_k_q6_k_eight_row_layouts_take_any_block(wtype: int) -> None:
    """Blocks of random bytes (every five- or six-bit value, every scale and min) with sane super-block scales and
    large activations: the int16 sums (at most 4 * 2 * 31 * 128, 2 * 2 * 63 * 128) and the int32 sums stay exact."""
    k, m = 512, 16
    rng = np.random.default_rng(24)
    size = BLOCK_BYTES[wtype]
    w = rng.integers(0, 256, (m, k // 256, size), dtype=np.uint8)
    if wtype == Q6_K:  # d last
        w[:, :, 208:210] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    else:  # d, dmin first
        w[:, :, 0:2] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
        w[:, :, 2:4] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    w = w.reshape(m, -1)
    x = rng.standard_normal((9, k)).astype(np.float32) * 50
    want = mul_mat(w, k, x, PORTABLE, wtype=wtype, rows8=True)
    for mode in MODES:
        assert_same_bits(mul_mat(w, k, x, mode, wtype=wtype, rows8=True), want, f"mode {mode}")
    scale = np.abs(x.astype(np.float64)) @ np.abs(dequantize(w, k, wtype)).T
    assert float((np.abs(want - mul_mat(w, k, x, OFF, wtype=wtype)) / scale).max()) < 1e-6


def test_bad_shapes_are_refused() -> None:
    w = random_weights(64, 4, seed=1)
    with pytest.raises(ValueError):
        _core.kernels_mul_mat(w, 64, np.zeros((2, 32), dtype=np.float32), AUTO)
    with pytest.raises(ValueError):  # a type without a kernel
        _core.kernels_mul_mat(w, 64, np.zeros((2, 64), dtype=np.float32), AUTO, type=6)
    with pytest.raises(ValueError):  # the eight-row layout of rows not a multiple of 8
        _core.kernels_mul_mat(random_weights(64, 4, seed=1, wtype=Q4_0), 64, np.zeros((2, 64), np.float32), AUTO,
                              type=Q4_0, rows8=True)
    with pytest.raises(ValueError, match="bytes"):  # rows shorter than the type's
        _core.kernels_mul_mat(w[:, :-4], 64, np.zeros((2, 64), dtype=np.float32), AUTO)
    with pytest.raises(ValueError):  # Q6_K: K not a multiple of 256
        _core.kernels_mul_mat(random_weights(256, 2, seed=1, wtype=Q6_K), 128, np.zeros((2, 128), np.float32), AUTO,
                              type=Q6_K)


# ---- a model: the tiny Llama quantized to Q4_1 and to Q8_0


@pytest.fixture(scope="module")
def tiny_q4_1(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_q4_1") / "tiny-q4_1.gguf"
    quantize_gguf(tiny_gguf, out, "q4_1", progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_q4_0(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_q4_0") / "tiny-q4_0.gguf"
    quantize_gguf(tiny_gguf, out, "q4_0", progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_q8_0(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_q8_0") / "tiny-q8_0.gguf"
    quantize_gguf(tiny_gguf, out, "q8_0", progress=False)
    return out


def test_the_option_is_in_the_table() -> None:
    row = specee.context_options.CONTEXT_OPTIONS["kernels"]
    assert row["default"] == "auto" and row["choices"] == ["auto", "portable", "off"]
    with pytest.raises(ValueError):
        specee.context_options.context_options({"kernels": "fast"})


@pytest.fixture(scope="module")
def tiny_k_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with rows of 256 and 512 (K-quants need multiples of 256), F32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specee.convert.hf import convert_hf_to_gguf

    torch.manual_seed(6)
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=256, tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("tiny_k")
    LlamaForCausalLM(cfg).save_pretrained(d / "hf")
    convert_hf_to_gguf(d / "hf", d / "f32.gguf", "f32")
    return d / "f32.gguf"


@pytest.fixture(scope="module")
def tiny_q6_k(tiny_k_f32: Path) -> Path:
    """Every matrix Q6_K."""
    quantize_gguf(tiny_k_f32, tiny_k_f32.with_name("q6_k.gguf"), "q6_k", progress=False)
    return tiny_k_f32.with_name("q6_k.gguf")


@pytest.fixture(scope="module")
def tiny_q4_k(tiny_k_f32: Path) -> Path:
    """Every matrix Q4_K (what ggml repacks on AVX2 and multiplies 4 tokens or more with a GEMM of other bits)."""
    quantize_gguf(tiny_k_f32, tiny_k_f32.with_name("q4_k.gguf"), "q4_k_s", progress=False)
    return tiny_k_f32.with_name("q4_k.gguf")


@pytest.fixture(scope="module")
def tiny_q5_k(tiny_k_f32: Path) -> Path:
    quantize_gguf(tiny_k_f32, tiny_k_f32.with_name("q5_k.gguf"), "q5_k_s", progress=False)
    return tiny_k_f32.with_name("q5_k.gguf")


@pytest.mark.parametrize("ftype", ["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"])
def test_model_logits_equal_with_kernels_on_and_off(ftype: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"tiny_{ftype}")
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 256, 23).tolist()
    want = None
    wtype = {"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0, "q4_k": Q4_K, "q5_k": Q5_K, "q6_k": Q6_K}[ftype]
    # with kernels off ggml repacks Q4_K (where it has AVX2) and its GEMM's bits differ from its GEMV's: off is no
    # reference there (test_q4_k_is_held_in_the_eight_row_layout_unless_kernels_are_off); Q4_1's, Q5_K's and Q6_K's
    # kernels have their own sums in the eight-row layout: off is within rounding of them, after the portable path and auto
    # agree bit for bit; Q4_0's kernel gives the bits of ggml's repacked Q4_0, which it uses with kernels off where
    # it has AVX2
    order = {Q4_K: ("portable", "auto"), Q4_1: ("portable", "auto", "off"), Q5_K: ("portable", "auto", "off"),
             Q6_K: ("portable", "auto", "off"),
             Q4_0: ("portable", "auto", "off") if REPACKS_Q4_0 else ("portable",)}.get(wtype, ("off", "portable", "auto"))
    for kernels in order:
        m = specee.Model(path, n_ctx=64, n_threads=2, kernels=kernels)
        built, quantized = _core.kernels_built(wtype), _core.kernels_built_quantizations()
        batch = m.eval(tokens, output="all")
        if kernels == "portable":  # the file's weights of that type went through the kernel (7 per layer at least)
            products = _core.kernels_built(wtype) - built
            assert products >= 7 * m.n_layer
            # Q, K and V read one quantization of their input, gate and up another: 4 per layer for 7 products
            assert products - (_core.kernels_built_quantizations() - quantized) >= 3 * m.n_layer
        elif kernels == "off":
            assert _core.kernels_built(wtype) == built
        m.kv_clear()
        single = np.concatenate([m.eval([t]) for t in tokens])
        assert_same_bits(batch, single, f"kernels={kernels}: batch vs one token at a time")
        if want is None:
            want = batch
        if wtype in (Q4_1, Q5_K, Q6_K) and kernels == "off":  # ggml's sums, in another order
            # a product differs from ggml's in the last bits (~1e-7 of it, the tests above), but the next layer's
            # activations are quantized again, and where a value sits near a rounding edge one quant moves by 1,
            # which the layers carry on: the tiny Q5_K model's logits move by 1.3e-2 of the largest from its third
            # token on (a perturbation of one product of layer 0 alone does it); a wrong block, scale or min moves
            # them by the logits' own size (docs/kernels.md, the perplexity over held-out text is the quality check)
            worst = float(np.abs(batch - want).max() / np.abs(want).max())
            assert 0 < worst < 5e-2, f"ggml's logits {worst:.2e} of the largest from the kernel's"
        else:
            assert_same_bits(batch, want, f"kernels={kernels} vs {order[0]}")
        m.close()


@pytest.mark.skipif(_core.kernels_auto_path() == "off", reason="ggml repacks Q4_K only with AVX2, as auto's path needs")
def test_q4_k_is_held_in_the_eight_row_layout_unless_kernels_are_off(tiny_q4_k: Path) -> None:
    """Under auto the loader keeps Q4_K out of ggml's repacking and holds its matrices (all of a multiple of 8 rows
    here) in the kernel's eight-row layout (the same bits for any batch); with kernels off ggml repacks them as upstream
    does (its GEMM for prefill)."""
    on = specee.Model(tiny_q4_k, n_ctx=64, n_threads=2)
    assert "Q4_K: " in on.placement and "eight-row layout" in on.placement, on.placement
    assert "CPU_REPACK" not in on.placement, on.placement
    on.close()
    off = specee.Model(tiny_q4_k, n_ctx=64, n_threads=2, kernels="off")
    assert "CPU_REPACK" in off.placement and "eight-row layout" not in off.placement, off.placement
    off.close()


@pytest.mark.skipif(not REPACKS_Q4_0, reason="ggml repacks Q4_0 into its 8x8 layout only with AVX2")
def test_q4_0_is_held_in_the_eight_row_layout_unless_kernels_are_off(tiny_q4_0: Path) -> None:
    """Under auto the loader holds Q4_0 in the kernel's eight-row layout instead of ggml's repacked one (the same bits:
    the kernel's are ggml's); with kernels off ggml repacks it as upstream does."""
    on = specee.Model(tiny_q4_0, n_ctx=64, n_threads=2)
    assert "Q4_0" in on.placement and "eight-row layout" in on.placement, on.placement
    on.close()
    off = specee.Model(tiny_q4_0, n_ctx=64, n_threads=2, kernels="off")
    assert "CPU_REPACK" in off.placement and "eight-row layout" not in off.placement, off.placement
    off.close()


def test_q4_1_is_held_in_the_eight_row_layout_unless_kernels_are_off(tiny_q4_1: Path) -> None:
    """The loader moves Q4_1 matrices of a multiple of 8 rows out of the mapping into the kernel's layout (auto and
    portable); with kernels off they stay mapped for ggml's mul_mat."""
    for kernels in ("auto", "portable"):
        m = specee.Model(tiny_q4_1, n_ctx=64, n_threads=2, kernels=kernels)
        assert "Q4_1: " in m.placement and "eight-row layout" in m.placement, m.placement
        m.close()
    off = specee.Model(tiny_q4_1, n_ctx=64, n_threads=2, kernels="off")
    assert "eight-row layout" not in off.placement, off.placement
    off.close()


@pytest.mark.parametrize("ftype", ["q4_0", "q4_1", "q4_k"])
def test_greedy_lookup_equals_plain_with_kernels(ftype: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"tiny_{ftype}")
    prompt = ([5, 17, 42, 9, 77, 3] * 6)[:30]
    # the kernel's own plain decoding is the reference (Q4_K with kernels off is repacked by ggml, Q4_1's kernel has
    # its own sums)
    want = specee.Model(path, n_ctx=256, n_threads=2, kernels="portable").generate_tokens(
        prompt, 40, temp=0, mode="plain", ignore_eos=True)
    for kernels in ("portable", "auto"):
        m = specee.Model(path, n_ctx=256, n_threads=2, kernels=kernels)
        for mode in ("plain", "ngram"):
            assert m.generate_tokens(prompt, 40, temp=0, mode=mode, ignore_eos=True) == want, (kernels, mode)
        m.close()


# ---- SmolLM2 (slow)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.attn_k.weight", "blk.7.ffn_down.weight",
                                  "blk.29.ffn_up.weight", "token_embd.weight"])
def test_smollm2_weights_against_ggml(smollm2_path: Path, name: str) -> None:
    """The file's Q8_0 token embeddings (the tied lm_head: 49,152 rows): ggml's bits. Its Q4_1 projections: the same
    bits for every row count, path and layout, within rounding of ggml's."""
    import gguf

    t = next(t for t in gguf.GGUFReader(smollm2_path).tensors if t.name == name)
    wtype = int(t.tensor_type)
    assert wtype == (Q8_0 if name == "token_embd.weight" else Q4_1)
    k, m = int(t.shape[0]), int(t.shape[1])
    w = np.ascontiguousarray(np.asarray(t.data, dtype=np.uint8).reshape(m, -1))
    rng = np.random.default_rng(1)
    for n in range(1, 17):
        x = rng.standard_normal((n, k)).astype(np.float32)
        ggml = mul_mat(w, k, x, OFF, wtype=wtype)
        if wtype == Q8_0:
            for mode in MODES:
                if mode == PORTABLE and n not in (1, 7, 16):
                    continue  # the portable path is slow; three row counts on real weights
                assert_same_bits(mul_mat(w, k, x, mode, wtype=wtype), ggml, f"{name} n={n} mode {mode}")
            continue
        got = mul_mat(w, k, x, AUTO if AUTO in MODES else PORTABLE, rows8=True)
        assert_within_rounding(got, ggml, w, k, x, f"{name} n={n}")
        assert_same_bits(mul_mat(w, k, x, MODES[-1]), got, f"{name} n={n}, the file's layout")
        if n in (1, 7, 16):
            assert_same_bits(mul_mat(w, k, x, PORTABLE), got, f"{name} n={n}, the portable path")
            assert_same_bits(mul_mat(w, k, x[-1:], MODES[-1], rows8=True), got[-1:], f"{name} n={n}, its last alone")


@pytest.mark.slow
def test_smollm2_greedy_identity_with_kernels(smollm2_path: Path) -> None:
    """ngram and eagle2 with kernels on give the tokens plain decoding gives with them (as a user runs it); plain with
    ggml's mul_mat mostly agrees too (the sums' order differs: a near-tie may go the other way)."""
    from specee.bench.spec import default_head

    prompts = ["The capital of France is", "def fibonacci(n):", "List three colours: red, green,"]
    on = specee.Model(smollm2_path, n_ctx=256, n_threads=2, kernels="auto", draft_head=default_head())
    want = [on.generate_tokens(on.tokenize(p), 32, temp=0, mode="plain", ignore_eos=True) for p in prompts]
    for p, w in zip(prompts, want):
        for mode in ("ngram", "eagle2"):
            assert on.generate_tokens(on.tokenize(p), 32, temp=0, mode=mode, ignore_eos=True) == w, (p, mode)
    on.close()
    off = specee.Model(smollm2_path, n_ctx=256, n_threads=2, kernels="off")
    same = sum(off.generate_tokens(off.tokenize(p), 32, temp=0, mode="plain", ignore_eos=True) == w
               for p, w in zip(prompts, want))
    off.close()
    assert same >= 2, f"only {same} of 3 greedy continuations agree with ggml's mul_mat"


@pytest.mark.slow
def test_smollm2_perplexity_with_kernels_on_and_off(smollm2_path: Path) -> None:
    """Teacher-forced on held-out text: Q4_1's own sums change the logits in the last bits, and the activations'
    quantization in every layer (a value rounded to another Q8 step) carries that to the quantization's own noise, a
    text's perplexity moving by up to 0.7 % either way (docs/kernels.md); over 24 texts, 8,245 tokens, within 0.1 %
    (measured -0.045 %; -0.09 % over the first ten)."""
    from specee.bench.filetype import held_out_texts, log_probs

    ppl = {}
    for kernels in ("off", "auto"):
        m = specee.Model(smollm2_path, n_ctx=520, n_threads=2, kernels=kernels)
        nll, n = 0.0, 0
        for text in held_out_texts(24):
            d = m.tokenize(text)[:512]
            lp = log_probs(m, d)
            nll -= lp[np.arange(len(d) - 1), d[1:]].sum()
            n += len(d) - 1
        ppl[kernels] = float(np.exp(nll / n))
        m.close()
    print(f"perplexity: kernels off {ppl['off']:.6f}, auto {ppl['auto']:.6f}")
    assert ppl["auto"] == pytest.approx(ppl["off"], rel=1e-3)


def mapped_rss_kib(path: Path) -> int:
    """This process's resident KiB of its mappings of the file at path (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[:1].isupper() or ":" not in line.split()[0]:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.slow
def test_smollm2_q4_1_copied_into_the_layout_leaves_the_mapping(smollm2_path: Path) -> None:
    """The loader reads the mapped Q4_1 bytes once to write the eight-row layout, then hands their pages back: the
    file's mapping does not stay resident beside the copy (before: peak RSS 1.9x llama.cpp's on a 7B Q4_1 file). Nor
    does decoding map them again: the layers' norms are copied out of the mapping too, whose pages they share with
    the matrices (before: a decode mapped 35 MB of the released matrices' pages again where the page cache holds large
    folios, about 4 MB where it does not); the tied Q8_0 token embedding, which the lm_head reads, stays mapped."""
    import gguf

    embd = next(t for t in gguf.GGUFReader(smollm2_path).tensors if t.name == "token_embd.weight")
    m = specee.Model(smollm2_path, n_ctx=64, n_threads=2)
    assert "eight-row layout" in m.placement
    rss = mapped_rss_kib(smollm2_path.resolve())
    m.eval([1, 2, 3, 4])
    m.eval([5])
    decoded = mapped_rss_kib(smollm2_path.resolve())
    m.close()
    assert rss < 8 * 1024, f"{rss} KiB of the file's mapping resident after the copy (its Q4_1 matrices: ~62 MiB)"
    # what the decode mapped beyond the token embedding (other tests' models of the same file may hold pages of their
    # own mappings, which the decode does not change)
    beyond = decoded - rss - int(embd.n_bytes) // 1024
    assert beyond < 2 * 1024, f"{beyond} KiB of the file's mapping made resident by a decode beyond the token embedding"


def test_the_int8_peak_is_measured_where_the_tiles_run() -> None:
    """bench.kernels holds the tiles against this CPU's peak: a positive rate of byte products where the SIMD path
    runs (between 1 and 1,000 G/s a thread on any CPU of this decade), -1 where it does not."""
    peak = _core.kernels_int8_peak(2_000_000)
    if _core.kernels_auto_path() == "off":
        assert peak == -1.0
    else:
        assert 1e9 < peak < 1e12, peak
    assert _core.kernels_int8_peak(0) == -1.0


def test_the_kernels_benchmark_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    """python -m specee.bench.kernels on a small Q4_0 matrix: a row per layout (the file's layout now runs the kernel
    too), each with its cost per n and its rate against the peak."""
    from specee.bench import kernels

    kernels.main(["--type", "q4_0", "-k", "256", "--rows", "64", "-n", "1,3", "--threads", "1", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert [r.split(" | ")[1] for r in rows] == ["auto", "auto rows8", "off"], rows
    for r in rows:
        cells = r.strip("| ").split(" | ")
        assert cells[2] == "1.00" and float(cells[3]) > 0, r
