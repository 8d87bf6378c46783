"""Triton's system shared-memory extension: status, register, unregister, in every worker; CUDA's refused.

Off unless the setting `shared_memory` is on; then a client on this host creates a POSIX
shared-memory object, registers a region of it under a name, and sends infer requests whose
inputs and outputs name the region (`shared_memory_region`, `shared_memory_offset`,
`shared_memory_byte_size`; app/protocol/v2/codec.py): no tensor bytes cross the socket.

Every worker must hold the same regions: a registration is checked here first (a client's
mistake is a 400 before anything is applied), then broadcast as a control command sticky per
registration (its name and a fresh id), so a worker started later opens it too; an
unregistration is broadcast under the same key and forgets it. `status`, `register` and `unregister` are the whole extension, for each
protocol's door to call.

CUDA shared memory: no region can ever be registered here, so the requests that only read or
clean up answer as Triton does for an empty set (all regions: an empty list; a named one: 404;
unregister, named or all: done, nothing to do). perf_analyzer's clean-up unregisters all CUDA
regions after every shared-memory run. Registering one is the 400 naming the extension and why.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from app.protocol.broadcast import apply_everywhere
from app.protocol.errors import InvalidInput, NotApplied, RegionNotFound, UnsupportedExtension
from app.protocol.fields import int_field, json_type, str_field
from app.protocol.shared_memory import SharedMemoryRegions, check_name, turned_off
from app.protocol.state import ServiceState

log = logging.getLogger("ffn_serve")

EXTENSION = "system_shared_memory"
REGISTER = "system_shared_memory.register"  # control commands
UNREGISTER = "system_shared_memory.unregister"
_REGISTER_FIELDS = ("key", "offset", "byte_size")


def sticky_key(name: str, registration: str) -> str:
    """One registration's key: replayed to later workers until that registration is undone."""
    return f"{EXTENSION}:{name}:{registration}"


def regions_of(state: ServiceState) -> SharedMemoryRegions:
    """The process's regions; 400 naming the extension and the setting when it is off."""
    if state.shared_memory is None:
        raise turned_off()
    return state.shared_memory


# ----- the extension, for any protocol ----------------------------------------------------------


def status(state: ServiceState, name: str | None = None) -> list[dict[str, Any]]:
    """Every region (name, key, offset, byte_size), or the named one (404 if not registered)."""
    return regions_of(state).status(name)


async def register(state: ServiceState, name: str, key: str, offset: int, byte_size: int) -> None:
    """Register a region in every serving process; 400 for a mistake, with nothing registered anywhere."""
    regions_of(state).check(name, key, offset, byte_size)
    registration = uuid.uuid4().hex
    args = {"name": name, "key": key, "offset": offset, "byte_size": byte_size, "registration": registration}
    sticky = sticky_key(name, registration)
    try:
        await apply_everywhere(state.control, REGISTER, args, sticky=sticky)
    except NotApplied:
        # All or nothing: where this registration was applied it is undone. Only this one: the
        # same name registered at the same moment through another worker stays as it is.
        undo = {"name": name, "registration": registration}
        await state.control.broadcast(UNREGISTER, undo, sticky=sticky, forget=True)
        raise


async def unregister(state: ServiceState, name: str | None = None) -> None:
    """Unregister the named region, or all of them, in every serving process. An unknown name is no error."""
    regions = regions_of(state)
    for each in [check_name(name)] if name is not None else regions.names():
        region = regions.find(each)
        if region is None:  # not here, so nowhere (every worker holds the same): nothing to forget
            await apply_everywhere(state.control, UNREGISTER, {"name": each})
            continue
        args = {"name": each, "registration": region.registration}
        await apply_everywhere(
            state.control, UNREGISTER, args, sticky=sticky_key(each, region.registration), forget=True
        )


# ----- the control handlers, in each process --------------------------------------------------


def control_handlers(regions: SharedMemoryRegions) -> dict[str, Any]:
    """Command name -> handler, for create_app to register."""

    async def on_register(args: dict[str, Any]) -> dict[str, Any]:
        region = regions.register(args["name"], args["key"], args["offset"], args["byte_size"], args["registration"])
        log.info("registered system shared memory region %s", region.status())
        return region.status()

    async def on_unregister(args: dict[str, Any]) -> dict[str, Any]:
        removed = regions.unregister(args["name"], args.get("registration"))
        if removed:
            log.info("unregistered system shared memory region %r", args["name"])
        return {"unregistered": removed}

    return {REGISTER: on_register, UNREGISTER: on_unregister}


async def register_document(state: ServiceState, region: str, document: object) -> None:
    """Register `region` from a register request's fields ({"key", "offset", "byte_size"}), checked (both doors)."""
    if not isinstance(document, dict):
        raise InvalidInput(f"a register request must be a JSON object, got {json_type(document)}")
    unknown = sorted(set(document) - set(_REGISTER_FIELDS))
    if unknown:
        raise InvalidInput(f"unknown register field {unknown[0][:64]!r}; the fields are {list(_REGISTER_FIELDS)}")
    key = str_field(document, "key", "register request")
    byte_size = int_field(document, "byte_size", "register request", minimum=1, maximum=2**63 - 1)
    offset = int_field(document, "offset", "register request", minimum=0, maximum=2**63 - 1)
    if key is None or byte_size is None:
        raise InvalidInput("a register request needs 'key' and 'byte_size' ('offset' defaults to 0)")
    await register(state, region, key, offset or 0, byte_size)


def _no_cuda_regions(state: ServiceState) -> str:
    """Why no CUDA region can be registered on this server."""
    if state.engine.cuda_available:
        return "this server opens no CUDA IPC handles"
    return "this server has no GPU, and CUDA shared memory lives on one"


def cuda_status(state: ServiceState, name: str | None = None) -> list[dict[str, Any]]:
    """CUDA regions' status: none is ever registered, so all of them is [] and a named one a 404 (both as Triton)."""
    if name is None:
        return []
    raise RegionNotFound(
        f"no cuda shared memory region named {check_name(name)!r} is registered: {_no_cuda_regions(state)}, so none ever is"
    )


def cuda_unregister(name: str | None = None) -> None:
    """Unregister a CUDA region, or all: none is registered, so done with nothing to do (an unknown name is no error)."""
    if name is not None:
        check_name(name)


async def cuda_register(state: ServiceState) -> None:
    """Registering a CUDA region: a 400 that says why (no GPU, or CUDA IPC not served); both doors."""
    why = _no_cuda_regions(state)
    raise UnsupportedExtension("cuda_shared_memory", f"{why}; use system shared memory (system_shared_memory)")
