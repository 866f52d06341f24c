"""The inductor options of every compiled model forward (`models/compiled.py`) are options inductor knows, and a
forward compiled with them by inductor itself (the suite's other CPU tests compile with "aot_eager",
`tests/conftest.py`) computes what the eager function computes."""

from __future__ import annotations

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
