"""gRPC server reflection, both versions: grpc.reflection.v1 (current grpcurl, Postman) and v1alpha (older tools).

grpcio-reflection (pinned, 1.81.1) serves only v1alpha (grpc/grpc#38576: no v1 in Python yet).
The v1 protocol is v1alpha's renamed: the same messages, fields and numbers in the package
grpc.reflection.v1 (grpc/reflection/v1/reflection.proto), so the bytes on the wire are the same.
v1 is therefore served by grpcio-reflection's own servicer under v1's method path, its messages
read and written with v1alpha's classes. v1's file descriptor, made from v1alpha's with the
package renamed, is added to the default pool so that the reflection service can describe its v1
self too (`grpcurl describe grpc.reflection.v1.ServerReflection`); no package installed here
ships that file.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
_METHOD = "ServerReflectionInfo"


def v1_file(pool: descriptor_pool.DescriptorPool | None = None) -> FileDescriptor:
    """grpc/reflection/v1/reflection.proto in `pool` (the default one), added from v1alpha's once."""
    pool = pool or descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old_package = proto.package
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    # v1's file options, as grpc-proto's v1/reflection.proto states them (v1alpha's file has none).
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_multiple_files = True
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"

    def renamed(type_name: str) -> str:
        return type_name.replace(f".{old_package}.", f".{V1_PACKAGE}.", 1)

    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = renamed(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = renamed(method.input_type), renamed(method.output_type)
    pool.Add(proto)
    return pool.FindFileByName(V1_FILE)


def enable(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection of `service_names` and of both reflection services, under v1 and v1alpha."""
    v1_file()
    servicer = reflection.aio.ReflectionServicer((*service_names, V1_SERVICE, V1ALPHA_SERVICE))
    handlers = {
        _METHOD: grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    for name in (V1_SERVICE, V1ALPHA_SERVICE):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
