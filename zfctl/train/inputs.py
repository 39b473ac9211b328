"""The run's inputs: tokenizer and prepared data, proved good before anything else happens.

Shared by the launcher (``zfctl.train.launch``, before torchrun starts the ranks) and
by every rank (``zfctl.train.session``). It imports neither of them, so the two never import each
other (tests/train/test_import_cycles.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from zfctl.errors import UserError
from zfctl.plan.schema import RunPlan

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from zfctl.train.data.prepare import PreparedData


def load_inputs(plan: RunPlan, *, rank: int) -> tuple[PreTrainedTokenizerBase, PreparedData]:
    """Tokenizer and prepared data (cached); every data problem surfaces here as a UserError.

    Called before the process group forms: a rank that fails here exits before any collective,
    and torchrun stops its peers instead of leaving them waiting in a rendezvous. Only ``rank`` 0
    prints the data summary.
    """
    from zfctl.train.data.prepare import prepare_data
    from zfctl.train.models.load import load_tokenizer

    tokenizer = load_tokenizer(plan.model)
    prepared = prepare_data(plan.data, tokenizer, seed=plan.train.seed)
    if rank == 0:
        Console().print(f"data: {prepared.summary()}", highlight=False, markup=False, soft_wrap=True)
        if prepared.cache_warning:
            Console(stderr=True).print(f"warning: {prepared.cache_warning}", style="yellow", highlight=False,
                                       markup=False, soft_wrap=True)
    if len(prepared.train) == 0:
        raise UserError(f"data {plan.data.name!r} has no training records after slicing/filtering; "
                        "check data.start_idx/end_idx")
    return tokenizer, prepared
