"""A stand-in of libtpu's runtime metrics service (`RuntimeMetricService`, gRPC), serving known values.

On a TPU VM libtpu serves it on each port of `TPU_RUNTIME_METRICS_PORTS` while a framework holds the chips, and
`tpu-info`'s client reads it (`tpu_info.metrics.get_chip_usage`, over `grpc.local_channel_credentials()`). Local
hosts have no TPU, so the chip columns of `tpuctl top` are tested against this: the proto is the one the
`tpu-info` package ships (its `observe` extra), so the wire format is the real client's.

Served: `tpu.runtime.hbm.memory.usage.bytes`, `tpu.runtime.hbm.memory.total.bytes` (per device, int gauges) and
`tpu.runtime.tensorcore.dutycycle.percent` (per chip, a double gauge), each with the device id in the metric's
attribute, as libtpu answers; any other name: NOT_FOUND.

Run: python -m infra.fake_tpu_metrics --port 8431 --chips 4    or, in tests: start(chips).
"""
from __future__ import annotations

import argparse
import sys
from concurrent import futures
from dataclasses import dataclass

import grpc
from tpu_info.proto import tpu_metric_service_pb2 as pb
from tpu_info.proto import tpu_metric_service_pb2_grpc as pb_grpc

HBM_USED = "tpu.runtime.hbm.memory.usage.bytes"
HBM_TOTAL = "tpu.runtime.hbm.memory.total.bytes"
DUTY_CYCLE = "tpu.runtime.tensorcore.dutycycle.percent"


@dataclass(frozen=True)
class Chip:
    device_id: int
    hbm_used: int
    hbm_total: int
    duty_cycle_pct: float


def known_chips(n: int = 4) -> list[Chip]:
    """Distinct values per chip that a table shows exactly: i+1 GiB used of 16 GiB (a v5e's), 12.5 x (i+1) %."""
    return [Chip(i, (i + 1) * 2**30, 16 * 2**30, 12.5 * (i + 1)) for i in range(n)]


class Service(pb_grpc.RuntimeMetricServiceServicer):
    def __init__(self, chips: list[Chip]):
        self.chips = chips
        self.calls: list[str] = []

    def GetRuntimeMetric(self, request, context):  # noqa: N802 - the service's method name
        self.calls.append(request.metric_name)
        gauges = {HBM_USED: lambda c: pb.Gauge(as_int=c.hbm_used),
                  HBM_TOTAL: lambda c: pb.Gauge(as_int=c.hbm_total),
                  DUTY_CYCLE: lambda c: pb.Gauge(as_double=c.duty_cycle_pct)}
        gauge = gauges.get(request.metric_name)
        if gauge is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"metric {request.metric_name} not found")
        metrics = [pb.Metric(attribute=pb.Attribute(key="device-id", value=pb.AttrValue(int_attr=c.device_id)),
                             gauge=gauge(c)) for c in reversed(self.chips)]  # the client sorts by device id
        return pb.MetricResponse(metric=pb.TPUMetric(name=request.metric_name, metrics=metrics))

    def ListSupportedMetrics(self, request, context):  # noqa: N802
        return pb.ListSupportedMetricsResponse(
            supported_metric=[pb.SupportedMetric(metric_name=n) for n in (HBM_USED, HBM_TOTAL, DUTY_CYCLE)])


@dataclass
class Running:
    server: grpc.Server
    service: Service
    port: int

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None)


def start(chips: list[Chip] | None = None, port: int = 0) -> Running:
    """Serves on localhost:PORT (0: a free one) with local credentials, which the client's
    `grpc.local_channel_credentials()` requires."""
    service = Service(chips if chips is not None else known_chips())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_RuntimeMetricServiceServicer_to_server(service, server)
    bound = server.add_secure_port(f"localhost:{port}", grpc.local_server_credentials())
    if not bound:
        raise OSError(f"cannot listen on localhost:{port}")
    server.start()
    return Running(server, service, bound)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.fake_tpu_metrics", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--chips", type=int, default=4)
    a = ap.parse_args(argv)
    r = start(known_chips(a.chips), a.port)
    print(f"serving RuntimeMetricService on {r.address}", flush=True)
    r.server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
