import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from mpirun import cost_model_cache  # noqa: E402


@pytest.fixture
def cost_model_dir() -> Path:
    """One PS cost-model cache for every test of this pytest process (calibration runs once per W, S)."""
    return cost_model_cache()
