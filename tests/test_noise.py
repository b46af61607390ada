"""Counter-based noise: every bit of a seed counts, and seeds below 2**32 keep the 32-bit hash's streams."""

import torch

from dspark_kernels.noise import _fmix32, uniform_noise


def _noise_32bit(seed: int, offset: int, n: int, stream: int = 0) -> torch.Tensor:
    """The hash on a seed's low 32 bits only (what a seed below 2**32 must keep giving)."""
    idx = torch.arange(n, dtype=torch.int64)
    s = _fmix32(torch.tensor([[seed]]) ^ 0x9E3779B9)
    h = _fmix32(s ^ (offset * 0x27D4EB2F + stream * 0x165667B1))
    h = _fmix32(h ^ idx[None, :])
    h = _fmix32(h + idx[None, :] * 0x9E3779B1)
    return (((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0))[0]


def test_seeds_below_2_32_keep_their_streams():
    for seed in (0, 1, 12345, 2**31 - 1, 2**32 - 1):
        got = uniform_noise(torch.tensor([seed]), torch.tensor([3]), (64,), stream=1)[0]
        assert torch.equal(got, _noise_32bit(seed, 3, 64, stream=1))


def test_the_high_bits_of_a_seed_change_the_noise():
    seeds = [5, 5 + 2**32, 5 + 2**33, 5 + 2**62, -5, 2**63 - 1]
    rows = uniform_noise(torch.tensor(seeds), torch.zeros(len(seeds), dtype=torch.int64), (256,))
    for i in range(len(seeds)):
        for j in range(i + 1, len(seeds)):
            assert not torch.equal(rows[i], rows[j]), (seeds[i], seeds[j])
    assert bool(((rows > 0) & (rows < 1)).all())


def test_generate_with_seeds_2_32_apart_samples_differently():
    from dspark_kernels.bench import ASSETS
    from dspark_kernels.models import generate, load_model

    target = load_model(ASSETS / "target")
    prompt = [[1, 200, 300, 400]]
    a = generate(target, prompt, 24, temperature=1.0, seeds=[7]).tokens[0]
    b = generate(target, prompt, 24, temperature=1.0, seeds=[7 + 2**32]).tokens[0]
    assert a != b and a == generate(target, prompt, 24, temperature=1.0, seeds=[7]).tokens[0]
