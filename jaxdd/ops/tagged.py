"""The JSON form of the spec's small immutable values (storage policies, kernel transforms).

Each is a frozen dataclass whose class is named in a spec file by a tag (a policy's ``kind``,
a transform's ``type``) and whose fields follow it, so one rule writes them all.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

__all__ = ["Tagged"]


@dataclasses.dataclass(frozen=True)
class Tagged:
    """Base of a frozen dataclass written as ``{tag_key: tag, **fields}``.

    A family names its tag attribute in ``tag_key`` (``"kind"``, ``"type"``); each class of the
    family sets that attribute as a ``ClassVar``.
    """

    tag_key: ClassVar[str] = ""

    def to_dict(self) -> dict:
        """The JSON form: the class's tag under ``tag_key``, then each field by name."""
        return {self.tag_key: getattr(self, self.tag_key),
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
