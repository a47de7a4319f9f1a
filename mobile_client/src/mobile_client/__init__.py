"""mobile_client: the phone side of HyCo. Never imports vLLM.

Public API (docs/phone-loop.md): run a phone session with ``HycoClient(server).run(PhoneSession(drafter,
...))``; drafters follow the ``Drafter`` protocol (``propose(context, node_budget) -> DraftTree``);
``HycoPhoneDrafter`` wraps HyCo's MTP + SLM drafters with the hooks the session calls.
"""

from mobile_client.client import (
    ConnectionLostError,
    HycoClient,
    HycoServerError,
    PhoneTimeoutError,
    Timeouts,
    run_session,
)
from mobile_client.drafters.base import DraftContext, Drafter, HybridDrafter, SpecEdgeDrafter
from mobile_client.session import HycoPhoneDrafter, PhoneSession, RoundStats, SessionOptions, SessionResult
from mobile_client.tree import DraftTree, build_tree

__version__ = "0.1.0"

__all__ = [
    "ConnectionLostError",
    "DraftContext",
    "DraftTree",
    "Drafter",
    "HybridDrafter",
    "HycoClient",
    "HycoPhoneDrafter",
    "HycoServerError",
    "PhoneSession",
    "PhoneTimeoutError",
    "RoundStats",
    "SessionOptions",
    "SessionResult",
    "SpecEdgeDrafter",
    "Timeouts",
    "build_tree",
    "run_session",
]
