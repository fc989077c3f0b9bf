"""Ranks that are not in the same collective (one saving, running a forward or a collective alone) raise a clear
ValueError on each rank (tests/integrations/out_of_step.py), and the self-checked report gather in one process."""

import pytest
import torch

from tests.helpers.harness import dist_suite
from ulysses_sp.validation import REPORT_SLOTS, Report, gather_reports

results, test_case, test_every_worker_case_is_checked = dist_suite(
    "tests.integrations.out_of_step",
    {2: ["save_on_one_rank", "forward_on_one_rank", "collective_of_its_own", "alone_until_timeout"]},
)


def test_one_process_gathers_its_own_report():
    assert gather_reports(torch.tensor([3, -1, 7]), Report.BATCH, None) == [[3, -1, 7]]


def test_a_report_longer_than_its_slots_is_an_internal_error():
    with pytest.raises(AssertionError):
        gather_reports(torch.zeros(REPORT_SLOTS - 2, dtype=torch.long), Report.FORWARD, None)
