"""`xpar-zoo size` prints parameter counts in human units for any size: no `0.00B` for a small model."""

import pytest

from xpar_zoo.sizing import format_count


@pytest.mark.parametrize("count, shown", [(0, "0"), (7, "7"), (999, "999"), (1000, "1.0K"), (12_345, "12.3K"),
                                          (999_499, "999K"), (999_600, "1.0M"), (4_500_000, "4.5M"),
                                          (30_532_122_624, "30.5B"), (235_000_000_000, "235B"),
                                          (1_200_000_000_000, "1.2T")])
def test_parameter_counts_print_in_human_units(count, shown):
    assert format_count(count) == shown
