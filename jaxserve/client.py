"""Clients for the jaxserve gRPC API (sync and asyncio), and a CLI:

    python -m jaxserve.client "def forward(self, x):" --max-tokens 64 --stream [--target HOST:PORT]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def build_request(prompt: str | list[int], *, max_tokens: int = 16, temperature: float | None = None,
                  top_k: int = 0, top_p: float | None = None, min_p: float = 0.0, seed: int | None = None,
                  stop: list[str] | None = None, stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                  logprobs: int = 0, request_id: str = "", session_id: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, top_k=top_k, min_p=min_p, stop=stop or [],
                                 stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos, logprobs=logprobs)
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling, session_id=session_id)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.extend(prompt)
    return request


@dataclass
class Completion:
    """A finished generation, gathered from its stream."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, response: pb.GenerateResponse) -> None:
        self.token_ids += response.token_ids
        self.text += response.text
        self.finish_reason = response.finish_reason or self.finish_reason
        self.num_prompt_tokens = response.num_prompt_tokens
        self.num_cached_tokens = response.num_cached_tokens


class Client:
    def __init__(self, target: str = DEFAULT_TARGET):
        self.channel = grpc.insecure_channel(target)
        self.stub = jaxserve_pb2_grpc.GenerationStub(self.channel)

    def stream(self, prompt: str | list[int], **sampling) -> Iterator[pb.GenerateResponse]:
        """The responses as they arrive; cancel with .cancel() on the returned call, or break out."""
        return self.stub.Generate(build_request(prompt, **sampling))

    def generate(self, prompt: str | list[int], **sampling) -> Completion:
        completion = Completion()
        for response in self.stream(prompt, **sampling):
            completion.add(response)
        return completion

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.ServerInfoRequest())

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids)).text

    def close(self) -> None:
        self.channel.close()


class AsyncClient:
    def __init__(self, target: str = DEFAULT_TARGET):
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = jaxserve_pb2_grpc.GenerationStub(self.channel)

    def stream(self, prompt: str | list[int], **sampling) -> AsyncIterator[pb.GenerateResponse]:
        return self.stub.Generate(build_request(prompt, **sampling))

    async def generate(self, prompt: str | list[int], **sampling) -> Completion:
        completion = Completion()
        async for response in self.stream(prompt, **sampling):
            completion.add(response)
        return completion

    async def close(self) -> None:
        await self.channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")
    args = parser.parse_args(argv)
    client = Client(args.target)
    try:
        completion = Completion()
        for response in client.stream(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                      seed=args.seed):
            completion.add(response)
            if args.stream:
                print(response.text, end="", flush=True)
        print("" if args.stream else completion.text)
        print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    except grpc.RpcError as error:
        print(f"jaxserve.client: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
