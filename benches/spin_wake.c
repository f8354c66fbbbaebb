/* Why a spinning waiter must yield: a process parked in epoll_wait on an
 * eventfd is woken by a writer that then spins for its answer. The kernel
 * queues the wakee on the writer's core (wake-affine placement); if the
 * writer spins without yielding, the wakee waits there for the next tick.
 *
 *   gcc -O2 -o /tmp/spin_wake benches/spin_wake.c
 *   /tmp/spin_wake TIMEOUT_MS IDLE_MS        # writer spins
 *   Y=1 /tmp/spin_wake TIMEOUT_MS IDLE_MS    # writer spins with sched_yield
 *
 * TIMEOUT_MS is the sleeper's epoll_wait timeout (-1: none). Measured on
 * the 2-core machine, 2026-12-01, IDLE_MS 1000: timeouts of 1..100 ms gave
 * 2.1-5.1 ms per wake without the yield, 30-180 us with it; -1 or 5000
 * gave 20-45 us either way (the sleeper stayed on its own core). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <time.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdint.h>
#include <sys/wait.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int argc,char**argv){
  int timeout_ms = argc>1?atoi(argv[1]):-1;
  int idle_ms = argc>2?atoi(argv[2]):1000;
  int efd=eventfd(0,EFD_NONBLOCK);
  atomic_int *flag=mmap(0,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  pid_t p=fork();
  if(p==0){
    int ep=epoll_create1(0);struct epoll_event ev={.events=EPOLLIN,.data.fd=efd};epoll_ctl(ep,EPOLL_CTL_ADD,efd,&ev);
    for(int i=0;i<5;i++){
      struct epoll_event out;
      while(epoll_wait(ep,&out,1,timeout_ms)==0){}
      uint64_t v;read(efd,&v,8);
      atomic_store(flag,i+1);
    }
    _exit(0);
  }
  for(int i=0;i<5;i++){
    usleep(idle_ms*1000);
    double t=now();
    uint64_t one=1;write(efd,&one,8);
    while(atomic_load(flag)!=i+1){ if(getenv("Y")) sched_yield(); }
    printf("%.1f us\n",now()-t);
  }
  wait(0);
}
