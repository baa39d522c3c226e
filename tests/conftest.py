import pytest


@pytest.fixture(scope="session")
def session_tmp_dir(tmp_path_factory):
    """One temporary directory shared by the whole test session (e.g. for generated checkpoints)."""
    return tmp_path_factory.mktemp("k3jax_session")
