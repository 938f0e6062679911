"""The PTX of the "asm" and "asm1" MXFP4 decoders (pallas_kernels/moe/decode.py), run by a small NumPy
emulator of the instructions they use, on every packed byte and scale byte: their bit logic is checked on
the CPU, where the kernels themselves run the "fast" stand-ins (the GPU tests compile the real thing).

Triton hands an instance with pack=4 the 4 packed bytes of consecutive elements in one 32-bit register
(element 0 in the low byte, $4) and one register per element for every other argument; $0..$3 are the
elements' results."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kimik3_jax import mxfp4
from pallas_kernels.moe import decode as dec

BF16 = ml_dtypes.bfloat16


def _bf16x2(u):
    """uint32 words -> (low, high) halves as float64."""
    lo = (u & 0xFFFF).astype(np.uint16).view(BF16).astype(np.float64)
    hi = (u >> 16).astype(np.uint16).view(BF16).astype(np.float64)
    return lo, hi


def _word(lo, hi):
    """float64 halves -> one uint32 word of bf16x2 (round to nearest even)."""
    bits = lambda x: x.astype(np.float32).astype(BF16).view(np.uint16).astype(np.uint32)
    return bits(lo) | (bits(hi) << 16)


def _prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:  # sign-replicate mode
            byte = np.where(byte & 0x80, 0xFF, 0).astype(np.uint32)
        out |= byte << (8 * i)
    return out


def run_ptx(asm: str, regs: dict) -> dict:
    """Execute the straight-line PTX `asm` on uint32 arrays: mov, shl, shr, and, or, prmt (default mode)
    and fma.rn.bf16x2 (exact products here, rounded once to bf16)."""
    regs = dict(regs)
    val = lambda x: np.uint32(int(x, 0)) if x[0].isdigit() else regs[x]
    for ins in asm.replace("{", ";").replace("}", ";").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        x = [val(a) for a in src]
        if op == "mov.b32":
            r = x[0] + np.zeros_like(regs["$4"])
        elif op == "shl.b32":
            r = (x[0] << x[1]) & np.uint32(0xFFFFFFFF)
        elif op == "shr.b32":
            r = x[0] >> x[1]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "prmt.b32":
            r = _prmt(x[0], x[1], int(src[2], 0))
        elif op == "fma.rn.bf16x2":
            (al, ah), (bl, bh), (cl, ch) = (_bf16x2(v) for v in x)
            with np.errstate(over="ignore", invalid="ignore"):  # +-inf past 2^128; NaN factors past the bound
                r = _word(al * bl + cl, ah * bh + ch)
        else:
            raise NotImplementedError(op)
        regs[d] = r.astype(np.uint32)
    return regs


def _cases(scales):
    """Every byte (256) for every scale byte: packed [S, 256] and scale [S, 16] (a group of 32 elements is
    16 bytes; a row's 16 groups share its scale byte)."""
    scale = np.asarray(scales, np.uint8)[:, None]
    packed = np.tile(np.arange(256, dtype=np.uint8), (len(scales), 1))
    return packed, np.repeat(scale, 16, axis=1)


def emulate(asm: str, packed, factors) -> np.ndarray:
    """Run `asm` with pack=4 over packed uint8 [r, c/2] and per-byte factor words [r, c/2] (one list entry
    per factor argument, in order) -> bf16 [r, c] in element order."""
    q = packed.astype(np.uint32).reshape(-1, 4)
    word = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    regs = {"$4": word}
    for j, f in enumerate(factors):
        f = f.reshape(-1, 4)
        regs.update({f"${5 + 4 * j + k}": f[:, k] for k in range(4)})
    out = run_ptx(asm, regs)
    pairs = np.stack([out[f"${k}"] for k in range(4)], axis=1).reshape(packed.shape)  # per byte: (lo, hi)
    bits = np.stack([pairs & 0xFFFF, pairs >> 16], axis=-1).reshape(packed.shape[0], -1)
    return bits.astype(np.uint16).view(BF16)


def _want(packed, scale):
    return np.asarray(mxfp4.dequantize(packed, scale, np.float32)).astype(BF16)


def test_asm_bit_logic_is_exact_for_every_byte_and_scale_1_to_254():
    packed, scale = _cases(range(1, 255))
    factors = [np.asarray(f) for f in dec.asm_factors(jnp.asarray(scale), packed.shape[-1])]
    got = emulate(dec._ASM, packed, factors)
    np.testing.assert_array_equal(got.view(np.uint16), _want(packed, scale).view(np.uint16))


def test_asm1_one_multiply_is_exact_up_to_its_bound_and_only_there():
    packed, scale = _cases(range(1, dec.QUICK_MAX_SCALE + 1))
    got = emulate(dec._ASM1, packed, [np.asarray(dec.asm1_factor(jnp.asarray(scale), packed.shape[-1]))])
    np.testing.assert_array_equal(got.view(np.uint16), _want(packed, scale).view(np.uint16))
    packed, scale = _cases([dec.QUICK_MAX_SCALE + 1])
    got = emulate(dec._ASM1, packed, [np.asarray(dec.asm1_factor(jnp.asarray(scale), packed.shape[-1]))])
    assert not np.array_equal(got.view(np.uint16), _want(packed, scale).view(np.uint16))


def test_asm1r_decodes_in_its_permuted_order():
    """_ASM1R: _ASM1's bits for every byte and scale byte 1..128, at positions 8w + p from elements
    8w + R_PERM[p] (as `permute8` orders them, and the interpreter's stand-in)."""
    packed, scale = _cases(range(1, dec.QUICK_MAX_SCALE + 1))
    got = emulate(dec._ASM1R, packed, [np.asarray(dec.asm1_factor(jnp.asarray(scale), packed.shape[-1]))])
    want = np.asarray(dec.permute8(jnp.asarray(_want(packed, scale)), dec.R_PERM))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    stand_in = np.asarray(dec.DECODERS["fast1r-unchecked"].full(jnp.asarray(packed), jnp.asarray(scale)))
    np.testing.assert_array_equal(stand_in.view(np.uint16), want.view(np.uint16))


def test_words_decode_gives_the_wgmma_operands_in_word_order():
    """Mosaic GPU's words decode (`wgmma_mxfp4.word_steps`): each thread's 16-bit registers of a [64, 32] byte
    tile in the WGMMA layout (row 16 w + l // 4 + 8 h, columns 8 g + 2 (l % 4) + {0, 1}) joined into a word per
    scale block, _WORD_ASM run on it, and its four results placed as `word_steps` places them, make the four
    wgmma A operands whose columns are the dequantised tile's in `word_order`, bit for bit (scale bytes
    1..128; each byte value 8 times, at shuffled positions: asm1r's bits for every byte at every position of a
    word are `test_asm1r_decodes_in_its_permuted_order`'s)."""
    from pallas_kernels.moe import wgmma_mxfp4 as wg

    rng = np.random.default_rng(0)
    tile = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), 8)).reshape(64, 32)
    scale = rng.integers(1, dec.QUICK_MAX_SCALE + 1, size=(64, 2), dtype=np.uint8)
    factor_bits = (scale.astype(np.uint32) + 126) << 7  # quick_scale_bits: 2^(s - 1) as bf16
    got = np.zeros((64, 64), np.uint16)  # [row, wgmma step x 16 + column]
    for w in range(4):
        for lane in range(32):
            j = lane % 4
            for h in range(2):
                row = 16 * w + lane // 4 + 8 * h
                for blk in range(2):
                    lo, hi = (tile[row, 8 * g + 2 * j: 8 * g + 2 * j + 2].astype(np.uint32)
                              for g in (2 * blk, 2 * blk + 1))
                    f = factor_bits[row, blk]
                    out = run_ptx(wg._WORD_ASM, {"$4": np.array([lo[0] | lo[1] << 8]),
                                                 "$5": np.array([hi[0] | hi[1] << 8]),
                                                 "$6": np.array([f | f << 16], np.uint32)})
                    # (step, column group) of $3, $2, $1, $0 as word_steps places them
                    for k, (step, group) in zip((3, 2, 1, 0), ((0, 0), (0, 1), (1, 0), (1, 1))):
                        col = 16 * (2 * blk + step) + 8 * group + 2 * j
                        got[row, col], got[row, col + 1] = out[f"${k}"][0] & 0xFFFF, out[f"${k}"][0] >> 16
    want = _want(tile, scale)[:, wg.word_order(64)]
    np.testing.assert_array_equal(got, want.view(np.uint16))
