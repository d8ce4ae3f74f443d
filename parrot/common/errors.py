"""Typed errors. Every layer raises these; the HTTP edge maps them once to OpenAI-style bodies.

Each class carries its HTTP status and an OpenAI-style ``type`` / ``code``; never classify errors by text.
"""

from __future__ import annotations


class ParrotError(Exception):
    """Base of every error Parrot raises on purpose. Unexpected exceptions are bugs (HTTP 500)."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


# ---- 4xx: the caller's input is wrong -------------------------------------------------------------------
class InvalidRequestError(ParrotError):
    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class BadSamplingParams(InvalidRequestError):
    code = "bad_sampling_params"


class ContextLengthExceeded(InvalidRequestError):
    code = "context_length_exceeded"


class LimitExceeded(InvalidRequestError):
    """Over one of the tenant's or the server's limits (prompt / output tokens, variables, session state); the
    message names the limit and ``param`` the field that crossed it."""

    code = "limit_exceeded"


class TemplateError(InvalidRequestError):
    code = "bad_template"


class TransformSpecError(InvalidRequestError):
    code = "bad_transform"


class CycleError(InvalidRequestError):
    code = "cycle"


class AuthenticationError(ParrotError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class InvalidSessionToken(AuthenticationError):
    """Missing or wrong X-Parrot-Session-Token for a session."""

    code = "invalid_session_token"


class InvalidEngineSecret(AuthenticationError):
    code = "invalid_engine_secret"


class EngineRegistrationClosed(ParrotError):
    """The server has no engine secret: no engine may register or heartbeat over HTTP."""

    status_code = 403
    error_type = "permission_error"
    code = "engine_registration_closed"


class NotFoundError(ParrotError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class UnknownContext(NotFoundError):
    code = "unknown_context"


class UnknownSession(NotFoundError):
    code = "unknown_session"


class UnknownVariable(NotFoundError):
    code = "unknown_variable"


class UnknownFlow(NotFoundError):
    code = "unknown_flow"


class UnknownToolCall(NotFoundError):
    code = "unknown_tool_call"


class UnknownModel(NotFoundError):
    code = "model_not_found"


class ConflictError(ParrotError):
    status_code = 409
    error_type = "invalid_request_error"
    code = "conflict"


class ContextExists(ConflictError):
    code = "context_exists"


class VariableAlreadySet(ConflictError):
    code = "variable_already_set"


class EngineNameTaken(ConflictError):
    code = "engine_name_taken"


class OpIdConflict(ConflictError):
    """A fill's ``op_id`` was used before for a different fill (op ids name one fill and its retries)."""

    code = "op_id_conflict"


class PayloadTooLarge(ParrotError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class RateLimited(ParrotError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limited"

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s  # sent as Retry-After (whole seconds, at least 1)


class PendingLimit(RateLimited):
    """The tenant has its ``max_pending`` requests in flight: retry when some finish (429 with Retry-After)."""

    code = "pending_limit"


# ---- failures of a step, reported at every dependent get ---------------------------------------------------
class StepFailed(ParrotError):
    """A producer step failed (engine, transform, context length...). ``cause_code`` names the root cause."""

    status_code = 424  # Failed Dependency
    error_type = "step_failed"
    code = "step_failed"

    def __init__(self, message: str, *, cause_code: str = "internal_error", param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.cause_code = cause_code

    def to_body(self) -> dict:
        body = super().to_body()
        body["error"]["cause"] = self.cause_code
        return body


class TransformFailed(ParrotError):
    status_code = 422
    error_type = "transform_error"
    code = "transform_failed"


class ConstraintIncomplete(ParrotError):
    """A constrained output ended before its grammar was complete (max_tokens, a stop string, the window): the
    value would not parse, so the step fails instead of passing it on."""

    status_code = 422
    error_type = "constraint_error"
    code = "constraint_incomplete"


# ---- 5xx: the service could not do it ----------------------------------------------------------------------
class EngineError(ParrotError):
    status_code = 502
    error_type = "engine_error"
    code = "engine_error"


class EngineUnavailable(EngineError):
    status_code = 503
    code = "engine_unavailable"


class EngineTimeout(EngineUnavailable):
    """An engine accepted a call and did not answer within its read timeout (hung, or stopped): the request path
    fails over like an unreachable engine; the heartbeat check declares it dead only after heartbeat_timeout_s."""

    status_code = 504
    code = "engine_timeout"


class ServerDraining(EngineUnavailable):
    """The server (or engine) is shutting down: it finishes the work it runs and takes nothing new."""

    code = "server_draining"


class NotReady(EngineUnavailable):
    """No engine has registered yet (the server is starting): retry after ``retry_after_s`` (503 + Retry-After),
    as vLLM answers before its model has loaded."""

    code = "not_ready"

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: float = 2.0) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class ModelNotFound(ParrotError):
    """The configured model file is missing (a setup problem, reported at startup)."""

    status_code = 500
    code = "model_missing"


# code -> class, so a client can rebuild the typed error from a JSON body (the wire is data, not pickles)
ERROR_CLASSES: dict[str, type[ParrotError]] = {}


def _register(cls: type[ParrotError]) -> None:
    ERROR_CLASSES.setdefault(cls.code, cls)
    for sub in cls.__subclasses__():
        _register(sub)


_register(ParrotError)


def error_from_body(status: int, body: dict) -> ParrotError:
    """Rebuild a typed error from an OpenAI-style error body (used by HTTP clients)."""
    err = body.get("error", body) if isinstance(body, dict) else {}
    message = str(err.get("message", f"HTTP {status}"))
    code = str(err.get("code") or "")
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        cls = InvalidRequestError if 400 <= status < 500 else EngineError
    if cls is StepFailed:
        return StepFailed(message, cause_code=str(err.get("cause") or "internal_error"), param=err.get("param"))
    return cls(message, param=err.get("param"))
