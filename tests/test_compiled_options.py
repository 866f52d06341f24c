"""The inductor options of every compiled model forward (`models/compiled.py`) are options inductor knows, and a
forward compiled with them by inductor itself (the suite's other CPU tests compile with "aot_eager",
`tests/conftest.py`) computes what the eager function computes."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from logitless.models.compiled import EAGER_NUMERICS, inductor_options
from tests.conftest import INDUCTOR_COMPILE


def test_every_option_is_one_inductor_knows():
    known = torch._inductor.config.get_config_copy()
    assert set(inductor_options(cudagraphs=True)) <= set(known) and set(EAGER_NUMERICS) <= set(known)


def test_inductor_compiles_with_the_options_on_cpu():
    torch._dynamo.reset()
    f = INDUCTOR_COMPILE(lambda x, w: torch.nn.functional.rms_norm(x @ w, (w.shape[1],)).to(torch.bfloat16).float(),
                         options=inductor_options())
    x, w = torch.randn(7, 5), torch.randn(5, 3)
    assert torch.allclose(f(x, w), torch.nn.functional.rms_norm(x @ w, (3,)).to(torch.bfloat16).float(), atol=1e-2)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_division_is_eagers_on_cuda():
    """GPU: an fp32 quotient compiled with EAGER_NUMERICS (a router's renormalised top-k weights) equals eager's to
    the bit; compiled without the exact-division key it is Triton's approximate division, which differs from eager on
    some of the same inputs (the baseline that shows the key matters)."""
    torch.manual_seed(0)
    x = torch.rand(1 << 16, 4, device="cuda") + 1e-3

    def renorm(x):
        return x / x.sum(-1, keepdim=True)

    eager = renorm(x)
    torch._dynamo.reset()
    exact = torch.compile(renorm, options=dict(EAGER_NUMERICS))(x)
    torch._dynamo.reset()
    approx = torch.compile(renorm, options={k: v for k, v in EAGER_NUMERICS.items() if "divi" not in k})(x)
    torch._dynamo.reset()
    assert torch.equal(exact, eager)
    assert not torch.equal(approx, eager), "Triton's division matched eager here: the baseline shows nothing"
