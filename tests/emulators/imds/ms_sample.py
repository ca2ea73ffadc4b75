"""Microsoft's documented Python sample for Scheduled Events (learn.microsoft.com, "Scheduled Events for Linux
VMs", Python sample), restated with the same requests, the same decisions and the same names (type hints added
for mypy). The only change a test makes is the base URL: it assigns ``metadata_url`` before ``advanced_sample``.
"""

import json
from time import sleep
from typing import Any

import requests

metadata_url = "http://169.254.169.254/metadata/scheduledevents"
header = {"Metadata": "true"}
query_params = {"api-version": "2020-07-01"}
logged: list[str] = []


def get_scheduled_events() -> Any:
    resp = requests.get(metadata_url, headers=header, params=query_params)
    return resp.json()


def confirm_scheduled_event(event_id: str) -> int:
    payload = json.dumps({"StartRequests": [{"EventId": event_id}]})
    response = requests.post(metadata_url, headers=header, params=query_params, data=payload)
    return response.status_code


def log(event: dict[str, Any]) -> None:
    # The sample prints the description; the test also keeps it to assert on.
    print(event["Description"])
    logged.append(event["Description"])


def advanced_sample(last_document_incarnation: Any) -> Any:
    found_document_incarnation = last_document_incarnation
    while last_document_incarnation == found_document_incarnation:
        sleep(1)
        payload = get_scheduled_events()
        found_document_incarnation = payload["DocumentIncarnation"]
    for event in payload["Events"]:
        if event["EventStatus"] == "Started":
            log(event)
        elif event["EventSource"] == "User":  # noqa: SIM114 - the sample keeps the two rules apart
            confirm_scheduled_event(event["EventId"])
        elif (
            event["EventType"] == "Freeze"
            and int(event["DurationInSeconds"]) >= 0
            and int(event["DurationInSeconds"]) < 9
        ):
            confirm_scheduled_event(event["EventId"])
        else:
            log(event)
    print("Processed events from document: " + str(found_document_incarnation))
    return found_document_incarnation
