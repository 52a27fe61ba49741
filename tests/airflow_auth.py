"""An Airflow auth manager with per-DAG read permissions, for the tests of the monitor's
authorization: Airflow's simple auth manager (roles only: every viewer reads every DAG)
plus a deny list, the way FAB or Keycloak DAG permissions restrict a user in production.
The api-server loads it through ``AIRFLOW__CORE__AUTH_MANAGER``; the deny list is
``IPCOUNT_TEST_DAG_DENY="user:dag_id,..."``."""
from __future__ import annotations

import os

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

PATH = "tests.airflow_auth.PerDagAuthManager"


class PerDagAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        denied = {tuple(pair.split(":", 1)) for pair in os.environ.get("IPCOUNT_TEST_DAG_DENY", "").split(",") if pair}
        if details is not None and (user.get_name(), details.id) in denied:
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
