import asyncio

from grpo_nb.actors import Actor, concurrent_endpoint, endpoint


class BoundedQueue(Actor):
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: list = []
        self.most = 0
        self.changed = asyncio.Condition()  # every put and get notifies it

    # Both endpoints may wait, so both must be concurrent: a waiting put inside a plain
    # endpoint would block the get that frees its slot (section 3's deadlock).
    @concurrent_endpoint
    async def put(self, item) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.items) < self.capacity)
            self.items.append(item)
            self.most = max(self.most, len(self.items))
            self.changed.notify_all()

    @concurrent_endpoint
    async def get(self):
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.items) > 0)
            item = self.items.pop(0)
            self.changed.notify_all()
            return item

    @endpoint
    async def high_water(self) -> int:
        return self.most
