"""Clients for the jaxserve gRPC API (sync and asyncio), and a CLI:

python -m jaxserve.client "def forward(self, x):" --max-tokens 64 --stream [--target HOST:PORT]
    [--api-key-file FILE] [--tls-ca CA.pem [--tls-cert CERT.pem --tls-key KEY.pem]]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

# the requests are built there; imported from here too, as they always were
from jaxserve.client_requests import build_chat_request, build_request
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass
class Completion:
    """A finished generation, gathered from its stream."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    request_id: str = ""
    # a chat with tools: the calls parsed from the reply, as OpenAI's tool_calls, and the text outside them
    tool_calls: list[dict] = field(default_factory=list)
    content: str = ""
    # a chat whose reply the server's reasoning parser split (GPT-OSS): its reasoning, kept out of text and content
    reasoning_content: str = ""
    # prompt_logprobs asked: {token_id: logprob} for each prompt token after the first (its own and the top)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    # the stop string or stop_token_ids entry that ended it (vLLM's stop_reason; None for EOS, length, ...)
    stop_reason: int | str | None = None

    index: int = 0  # which of a request's n completions

    def add(self, response: pb.GenerateResponse) -> None:
        self.token_ids += response.token_ids
        self.text += response.text
        self.reasoning_content += response.reasoning_content
        self.finish_reason = response.finish_reason or self.finish_reason
        self.num_prompt_tokens = response.num_prompt_tokens
        self.num_cached_tokens = response.num_cached_tokens
        self.request_id = response.request_id or self.request_id
        if (which := response.WhichOneof("stop_reason")) is not None:
            self.stop_reason = getattr(response, which)
        self.prompt_logprobs += [
            {**{top.token_id: top.logprob for top in entry.top}, entry.token_id: entry.logprob}
            for entry in response.prompt_logprobs
        ]
        if response.tool_calls:
            self.content = response.content
            self.tool_calls += [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in response.tool_calls
            ]


def gathered(responses) -> list[Completion]:
    """A stream's messages gathered per completion (each message names its completion in `index`), in index order."""
    completions: dict[int, Completion] = {}
    for response in responses:
        completions.setdefault(response.index, Completion(index=response.index)).add(response)
    return [completions[index] for index in sorted(completions)]


def single(completions: list[Completion], n: int, method: str) -> Completion:
    if n > 1:
        raise ValueError(f"n = {n} asks for {n} completions: {method}_n returns them, one Completion each")
    return completions[0] if completions else Completion()


@dataclass(frozen=True)
class Connection:
    """How to reach a server: TLS (root_certificates: the CA that signed the server's certificate;
    private_key and certificate_chain: this client's, for mutual TLS) and an API key. PEM bytes."""

    api_key: str | None = None
    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    @property
    def uses_tls(self) -> bool:
        return any(v is not None for v in (self.root_certificates, self.private_key, self.certificate_chain))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()


class Client:
    def __init__(self, target: str = DEFAULT_TARGET, connection: Connection = Connection()):
        self.channel = (
            grpc.secure_channel(target, connection.credentials())
            if connection.uses_tls
            else grpc.insecure_channel(target)
        )
        self.metadata = connection.metadata
        self.stub = jaxserve_pb2_grpc.GenerationStub(self.channel)

    def stream(self, prompt: str | list[int], **sampling) -> Iterator[pb.GenerateResponse]:
        """The responses as they arrive; cancel with .cancel() on the returned call, or break out."""
        return self.stub.Generate(build_request(prompt, **sampling), metadata=self.metadata)

    def generate(self, prompt: str | list[int], **sampling) -> Completion:
        """The one completion of a request with n = 1 (generate_n: several)."""
        return single(self.generate_n(prompt, **sampling), sampling.get("n", 1), "generate")

    def generate_n(self, prompt: str | list[int], **sampling) -> list[Completion]:
        """The request's n completions (sampling n, default 1), in index order."""
        return gathered(self.stream(prompt, **sampling))

    def chat_stream(self, messages: list[dict], **options) -> Iterator[pb.GenerateResponse]:
        """options: build_chat_request's keyword arguments (tools, tool_choice, sampling...)."""
        return self.stub.Chat(build_chat_request(messages, **options), metadata=self.metadata)

    def chat(self, messages: list[dict], **options) -> Completion:
        """The one reply of a request with n = 1 (chat_n: several)."""
        return single(self.chat_n(messages, **options), options.get("n", 1), "chat")

    def chat_n(self, messages: list[dict], **options) -> list[Completion]:
        return gathered(self.chat_stream(messages, **options))

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.ServerInfoRequest(), metadata=self.metadata)

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids), metadata=self.metadata).text

    def close(self) -> None:
        self.channel.close()


class AsyncClient:
    def __init__(self, target: str = DEFAULT_TARGET, connection: Connection = Connection()):
        self.channel = (
            grpc.aio.secure_channel(target, connection.credentials())
            if connection.uses_tls
            else grpc.aio.insecure_channel(target)
        )
        self.metadata = connection.metadata
        self.stub = jaxserve_pb2_grpc.GenerationStub(self.channel)

    def stream(self, prompt: str | list[int], **sampling) -> AsyncIterator[pb.GenerateResponse]:
        return self.stub.Generate(build_request(prompt, **sampling), metadata=self.metadata)

    def chat_stream(self, messages: list[dict], **options) -> AsyncIterator[pb.GenerateResponse]:
        return self.stub.Chat(build_chat_request(messages, **options), metadata=self.metadata)

    async def chat(self, messages: list[dict], **options) -> Completion:
        return single(await self.chat_n(messages, **options), options.get("n", 1), "chat")

    async def chat_n(self, messages: list[dict], **options) -> list[Completion]:
        return gathered([response async for response in self.chat_stream(messages, **options)])

    async def server_info(self) -> pb.ServerInfo:
        return await self.stub.GetServerInfo(pb.ServerInfoRequest(), metadata=self.metadata)

    async def generate(self, prompt: str | list[int], **sampling) -> Completion:
        return single(await self.generate_n(prompt, **sampling), sampling.get("n", 1), "generate")

    async def generate_n(self, prompt: str | list[int], **sampling) -> list[Completion]:
        return gathered([response async for response in self.stream(prompt, **sampling)])

    async def close(self) -> None:
        await self.channel.close()


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file",
        help="a file whose first key line is the API key (blank and # lines skipped, as server.api_keys)",
    )
    parser.add_argument("--tls-ca", help="PEM: the CA that signed the server's certificate (turns TLS on)")
    parser.add_argument("--tls-cert", help="PEM: this client's certificate, for mutual TLS")
    parser.add_argument("--tls-key", help="PEM: this client's private key, for mutual TLS")


def first_api_key(text: str, source: str) -> str:
    """The key a client sends from a key file read as the server reads server.api_keys (one key a line,
    blank lines and # comments skipped): its first; ValueError naming `source` when it holds none."""
    keys = [line.strip() for line in text.splitlines()]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise ValueError(f"{source} holds no key (blank lines and lines starting with # are skipped)")
    return keys[0]


def connection_from_arguments(args: argparse.Namespace) -> Connection:
    """ValueError naming the option when a file cannot be read or the key file holds no key."""

    def read(path: str, option: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as error:
            raise ValueError(f"cannot read {option} {path}: {error}") from None

    def read_if_given(path: str | None, option: str) -> bytes | None:
        return read(path, option) if path is not None else None

    api_key = None
    if args.api_key_file:
        text = read(args.api_key_file, "--api-key-file").decode(errors="replace")
        api_key = first_api_key(text, f"--api-key-file {args.api_key_file}")
    return Connection(
        api_key=api_key,
        root_certificates=read_if_given(args.tls_ca, "--tls-ca"),
        private_key=read_if_given(args.tls_key, "--tls-key"),
        certificate_chain=read_if_given(args.tls_cert, "--tls-cert"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")
    add_connection_arguments(parser)
    args = parser.parse_args(argv)
    try:
        connection = connection_from_arguments(args)
    except ValueError as error:
        print(f"jaxserve.client: {error}", file=sys.stderr)
        return 2
    client = Client(args.target, connection)
    try:
        completion = Completion()
        for response in client.stream(
            args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        ):
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
