"""Shapes and a local file server shared by the release tooling's tests (test_releases_*.py).

`BUGGY_V2` and `V32_FORWARD` are hand-written modules in vLLM's buggy shapes, small enough to zip
into test wheels; the real published sources are in tests/sources/ (test_stored_sources.py).
`serve` serves bytes from 127.0.0.1, honouring HTTP Range or not.
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

# -- a local file server, with and without Range ---------------------------------------------------


class _Files(BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}
    honour_range = True
    log: ClassVar[list[tuple[str, str | None]]] = []  # (path, Range header) per request

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        asked = self.headers.get("Range")
        self.log.append((self.path, asked))  # before answering: the client may check it at once
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", asked or "")
        if not self.honour_range or match is None:
            self._send(200, data, {})
        else:
            first, last = match.groups()
            if not first:
                start, stop = max(0, len(data) - int(last)), len(data)
            else:
                start, stop = int(first), min(len(data), int(last) + 1 if last else len(data))
            headers = {"Content-Range": f"bytes {start}-{stop - 1}/{len(data)}"}
            self._send(206, data[start:stop], headers)

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # keep pytest's output clean
        pass


def serve(honour_range: bool, files: dict[str, bytes]) -> tuple[ThreadingHTTPServer, str, list]:
    log: list = []
    handler = type("Handler", (_Files,), {"files": files, "honour_range": honour_range, "log": log})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", log


BUGGY_V2 = """
import torch


class DeepseekV2Model(torch.nn.Module):
    def forward(self, input_ids):  # an older definition: the last one wins
        return input_ids

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            hidden_states = self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        aux_hidden_states = []
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
            if idx in self.aux_hidden_state_layers:
                aux_hidden_states.append(hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        if len(aux_hidden_states) > 0:
            return hidden_states, aux_hidden_states
        return hidden_states
"""

MEMBER = "vllm/model_executor/models/deepseek_v2.py"


# -- the DeepSeek V3.2 forward's buggy shape ---------------------------------------------------------

V32_FORWARD = """
def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
    if get_pp_group().is_first_rank:
        hidden_states = self.embed_input_ids(input_ids)
        residual = None
    else:
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    aux_hidden_states = []
    for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
        if idx in self.aux_hidden_state_layers:
            aux_hidden_states.append(hidden_states + residual)
        hidden_states, residual = layer(positions, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
    hidden_states, _ = fused_allreduce_rms_norm(hidden_states, residual, self.norm)
    if len(aux_hidden_states) > 0:
        return hidden_states, aux_hidden_states
    return hidden_states
"""
