import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "scripts"))


@pytest.fixture(scope="session")
def cost_model_dir(tmp_path_factory):
    """One PS cost-model cache for the whole test session (calibration runs once per W, S)."""
    return tmp_path_factory.mktemp("costmodel")
