"""bench/kernel_revisions.py: another revision's kernels are built from git and run the same
linear as this checkout's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from bench.kernel_revisions import build_revision
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import isa

REPO = Path(__file__).resolve().parents[2]


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler on this machine")
@pytest.mark.skipif(not _in_git_checkout(), reason="not a git checkout: no revision to build")
def test_a_revisions_kernels_compute_what_this_checkouts_do(tmp_path, monkeypatch):
    """Both at the portable tier, whose build is the shortest."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(isa, "selected_tier", lambda: isa.Tier.PORTABLE)
    lib = build_revision("HEAD", tmp_path)
    here = cpu_kernels.load_library()
    assert lib.linear_panel_width() == here.linear_panel_width()
    weight = torch.randn(70, 64)
    x = torch.randn(5, 64)
    panels = cpu_kernels.pack_linear(weight)
    ours = cpu_kernels.linear(x, panels, None, 64, 70)
    monkeypatch.setattr(cpu_kernels, "load_library", lambda tier=None: lib)
    theirs = cpu_kernels.linear(x, panels, None, 64, 70)
    # the library is a different build of the same sources: same numbers
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(theirs, x @ weight.T, rtol=1e-5, atol=1e-5)
