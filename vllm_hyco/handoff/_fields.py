"""Strict field access for decoded msgpack maps (shared by the hand-off schema and the frames).

Every helper raises the error class it is given (FrameError or HandoffSchemaError) with a code and a
message naming the field, so no decoder ever lets a KeyError/TypeError/ValueError escape.
"""

from __future__ import annotations

import builtins
from typing import Any, Literal, TypeVar, overload

import msgpack

from vllm_hyco.errors import HycoError

_MISSING = object()
_T = TypeVar("_T")
_D = TypeVar("_D")

# bool is an int subclass in Python; these helpers never accept a bool where an int is asked for.
_TYPE_NAMES = {int: "int", str: "str", bytes: "bin", bool: "bool", float: "float", dict: "map", list: "array"}


def pack(obj: Any) -> bytes:
    """The one msgpack encoder: bin type for bytes, str for text, float64, no ext types."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: Any, err: type[HycoError], max_bytes: int, what: str) -> Any:
    """Decode one msgpack object; every failure becomes ``err`` (code ``bad_msgpack``)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise err(f"{what}: expected a binary message, got {type(data).__name__}", code="bad_msgpack")
    if len(data) > max_bytes:
        raise err(f"{what}: {len(data)} bytes is over the limit of {max_bytes}", code="frame_too_large")
    try:
        # unpackb bounds every str/bin/array/map length by the buffer's own size (msgpack >= 1.0)
        return msgpack.unpackb(bytes(data), raw=False, use_list=True, strict_map_key=True)
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        RecursionError,
        UnicodeDecodeError,
        OverflowError,
        MemoryError,
    ) as e:
        raise err(
            f"{what}: not a valid msgpack message ({type(e).__name__}: {e})", code="bad_msgpack"
        ) from None
    except Exception as e:  # msgpack's C extension may raise other internals on corrupt input
        raise err(f"{what}: not a valid msgpack message ({type(e).__name__})", code="bad_msgpack") from None


class Fields:
    """Reads one decoded map, checking types; ``done()`` rejects keys nobody read (strict schema)."""

    # ``int`` is also a method name here, so the annotations in this class spell the type ``builtins.int``.
    # The overloads say what a getter returns: ``optional=True`` adds None (or the ``default`` given).
    obj: dict[Any, Any]  # the decoded map
    err: type[HycoError]
    where: str
    seen: set[str]  # the keys read so far

    def __init__(self, obj: Any, err: type[HycoError], where: str) -> None:
        if not isinstance(obj, dict):
            raise err(f"{where}: expected a map, got {_type_name(obj)}", code="bad_field_type")
        self.obj, self.err, self.where, self.seen = obj, err, where, set()

    @overload
    def get(self, key: str, typ: type[_T], *, optional: Literal[False] = ..., default: Any = ...) -> _T: ...
    @overload
    def get(self, key: str, typ: type[_T], *, optional: bool, default: None = ...) -> _T | None: ...
    @overload
    def get(self, key: str, typ: type[_T], *, optional: bool, default: _D) -> _T | _D: ...
    @overload
    def get(self, key: str, typ: tuple[type, ...], *, optional: bool = ..., default: Any = ...) -> Any: ...

    def get(
        self, key: str, typ: type | tuple[type, ...], *, optional: bool = False, default: Any = None
    ) -> Any:
        self.seen.add(key)
        value = self.obj.get(key, _MISSING)
        if value is _MISSING or (optional and value is None):
            if optional:
                return default
            raise self.err(f"{self.where}: missing field {key!r}", code="missing_field")
        if not _is_type(value, typ):
            raise self.err(
                f"{self.where}: field {key!r} must be {_expect_name(typ)}, got {_type_name(value)}",
                code="bad_field_type",
            )
        return value

    @overload
    def int(
        self, key: str, lo: builtins.int, hi: builtins.int, *, optional: Literal[False] = ...
    ) -> builtins.int: ...
    @overload
    def int(self, key: str, lo: builtins.int, hi: builtins.int, *, optional: bool) -> builtins.int | None: ...

    def int(
        self, key: str, lo: builtins.int, hi: builtins.int, *, optional: bool = False
    ) -> builtins.int | None:
        value = self.get(key, int, optional=optional)
        if value is not None and not lo <= value <= hi:
            raise self.err(
                f"{self.where}: field {key!r} = {value} is outside [{lo}, {hi}]", code="bad_field_value"
            )
        return value

    @overload
    def bin(self, key: str, *, optional: Literal[False] = ...) -> bytes: ...
    @overload
    def bin(self, key: str, *, optional: bool) -> bytes | None: ...

    def bin(self, key: str, *, optional: bool = False) -> bytes | None:
        return self.get(key, bytes, optional=optional)

    @overload
    def choice(
        self, key: str, allowed: tuple[str, ...], *, optional: Literal[False] = ..., default: str | None = ...
    ) -> str: ...
    @overload
    def choice(
        self, key: str, allowed: tuple[str, ...], *, optional: bool, default: str | None = ...
    ) -> str | None: ...

    def choice(
        self, key: str, allowed: tuple[str, ...], *, optional: bool = False, default: str | None = None
    ) -> str | None:
        value = self.get(key, str, optional=optional, default=default)
        if value is not None and value not in allowed:
            raise self.err(
                f"{self.where}: field {key!r} = {value!r}; expected one of {list(allowed)}",
                code="bad_field_value",
            )
        return value

    def done(self) -> None:
        extra = [k for k in self.obj if k not in self.seen]
        if extra:
            raise self.err(
                f"{self.where}: unknown field(s) {sorted(map(str, extra))}; this protocol version "
                f"does not define them",
                code="unknown_field",
            )


def _is_type(value: Any, typ: type | tuple[type, ...]) -> bool:
    types = typ if isinstance(typ, tuple) else (typ,)
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, tuple(t for t in types if t is not bool))


def _type_name(value: Any) -> str:
    for t, name in _TYPE_NAMES.items():
        if type(value) is t:
            return name
    return "nil" if value is None else type(value).__name__


def _expect_name(typ: type | tuple[type, ...]) -> str:
    types = typ if isinstance(typ, tuple) else (typ,)
    return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
