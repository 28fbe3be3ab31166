"""The base of every configuration section: keyword-only fields, and an unknown key is an error naming it."""

import msgspec


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass
