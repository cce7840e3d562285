"""The vendor signatures (tests/vendor_emulation/real_signatures.py, read from the real
aiter and flash-attn sources) against the test-only emulations the adapter tests run on, and
against the real packages where they import (a GPU machine with them installed; skipped
here, saying why). What this proves: the emulations take the real parameters in the real
order with the real defaults, so an adapter call that binds against the emulation binds
against the package too; what the kernels compute is only proved on the hardware."""
from __future__ import annotations

import pytest

from vendor_emulation import aiter_emulation, flash_attn_emulation
from vendor_emulation.real_signatures import (AITER, AITER_VERSION, FLASH_ATTN,
                                              FLASH_ATTN_VERSION, import_real_vendor,
                                              signature_of)

# vendor module -> (the checked-in signatures, their version, the emulation)
VENDORS = {"aiter": (AITER, AITER_VERSION, aiter_emulation),
           "flash_attn": (FLASH_ATTN, FLASH_ATTN_VERSION, flash_attn_emulation)}
CASES = [(vendor, name) for vendor, (table, _, _) in VENDORS.items() for name in sorted(table)]


@pytest.mark.parametrize("vendor, name", CASES)
def test_emulated_signatures_equal_the_real_ones(vendor, name):
    table, _, emulation = VENDORS[vendor]
    assert signature_of(getattr(emulation, name)) == table[name]


@pytest.mark.parametrize("vendor, name", CASES)
def test_real_signatures_equal_the_checked_in_copy(vendor, name):
    table, checked_in, _ = VENDORS[vendor]
    module = import_real_vendor(vendor)
    version = getattr(module, "__version__", "unknown")
    assert signature_of(getattr(module, name)) == table[name], (
        f"{vendor} {version} differs from the {checked_in} copy in real_signatures.py")
