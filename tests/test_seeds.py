from areal_aio.seeds import SEED_BITS, UNIFORM_BITS, derive, sample_seed, uniform


def test_uniforms_are_exact_float32_steps_in_unit_interval_and_spread():
    us = [uniform(7, j) for j in range(20_000)]
    assert all(0 <= u < 1 and (u * 2 ** UNIFORM_BITS).is_integer() for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.01
    assert sum(u < 0.1 for u in us) / len(us) == __import__("pytest").approx(0.1, abs=0.01)


def test_seeds_differ_per_sample_group_retry_and_run_and_fit_63_bits():
    seeds = {sample_seed(r, g, i, k) for r in range(2) for g in range(50) for i in range(8) for k in range(3)}
    assert len(seeds) == 2 * 50 * 8 * 3 and max(seeds) < 2 ** SEED_BITS
    assert all(sample_seed(r, g, i, k) == derive(r, g, i, k)  # the per-group shortcut is derive
               for r in (0, 2**40 + 3) for g in (0, 7, 2**33) for i in range(3) for k in range(2))
    assert derive(1, 2) != derive(2, 1)
    assert [uniform(5, j) for j in range(4)] != [uniform(6, j) for j in range(4)]
