from grpo_nb.actors import concurrent_endpoint


class FixedManager(Manager):  # noqa: F821 (Manager is the notebook's)
    # A concurrent plan runs as its own task: while it awaits the helper, the manager's
    # mailbox is free to handle the helper's `confirm`.
    @concurrent_endpoint
    async def plan(self, me) -> str:
        return await self.helper.help.call_one(me)
