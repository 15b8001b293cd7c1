"""Fast BLAS on Linux CPU (placeholder: being written)."""


def blas_status() -> str:
    return "blas: unknown"
