"""Every trainable head kind by its --kind name. A new head type registers here (and in options.KINDS)."""

from __future__ import annotations

from speclens.engine.tools.train.dflash import DFlashKind
from speclens.engine.tools.train.eagle import EagleKind
from speclens.engine.tools.train.eagle3 import Eagle3Kind
from speclens.engine.tools.train.kind import HeadKind
from speclens.engine.tools.train.medusa import MedusaKind

HEAD_KINDS: dict[str, HeadKind] = {kind.name: kind for kind in (EagleKind(), Eagle3Kind(), DFlashKind(), MedusaKind())}
